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
    train = commands.add_parser(
        "train",
        help="GRPO with the TNT reward (no config: the embedded tiny model on the synthetic task)",
        description="Trains with GRPO and the configured reward. Without --config it runs the embedded default: "
        "a tiny Qwen2 model warmed up on the synthetic task (cached), then GRPO with the TNT reward.",
    )
    train.add_argument("--config", help="a YAML config (configs/*.yaml); default: the embedded tiny setup")
    train.add_argument("--output-dir", default="runs/train", help="where config, metrics, checkpoints go")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=10")
    args = parser.parse_args(argv)

    if args.command == "train":
        return _train(args)

    if args.command == "selfcheck":
        # imported here: the kernel package picks compiled or interpreted Triton when it is first imported
        from fasttnt_kernels.selfcheck import main as selfcheck

        return selfcheck(["--quick"] if args.quick else [])
    parser.error(f"unknown command {args.command!r}")
    return 2


def _train(args) -> int:
    from pathlib import Path

    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"fasttnt train: config error: {err}", file=sys.stderr)
        return 2
    import time

    from transformers.utils import logging as hf_logging

    from .plots import summary_table
    from .trainer import Trainer

    hf_logging.disable_progress_bar()  # our bars say what is happening; its per-file bars only add noise

    start = time.perf_counter()
    trainer = Trainer(cfg, Path(args.output_dir), resume=args.resume)
    history = trainer.run()
    print()
    print(summary_table(history))
    print(
        f"\nwall time {time.perf_counter() - start:.0f} s; outputs in {args.output_dir}: config.yaml, "
        "metrics.jsonl, checkpoints/, final/, curves.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
