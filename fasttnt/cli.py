"""The ``fasttnt`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fasttnt", description="GRPO for hybrid reasoning models with the TNT reward")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "selfcheck",
        help="check every Triton kernel against its float64 reference on this machine",
        description="Runs each kernel at realistic shapes (compiled on CUDA, interpreted on the CPU) against its "
        "plain-PyTorch reference in float64; exits 1 if any is off.",
    )
    check.add_argument("--quick", action="store_true", help="smaller shapes (seconds under the interpreter)")
    args = parser.parse_args(argv)

    if args.command == "selfcheck":
        # imported here: the kernel package picks compiled or interpreted Triton when it is first imported
        from fasttnt_kernels.selfcheck import main as selfcheck

        return selfcheck(["--quick"] if args.quick else [])
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
