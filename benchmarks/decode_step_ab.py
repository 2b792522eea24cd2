"""The hf engine's generate through this checkout's written-out decode step, through transformers' forward, and
(``--against REV``) through another commit's ``fasttnt/engines/decode_step.py``, taking turns round by round in one
process on the same prompts and seeds.

    python benchmarks/decode_step_ab.py MODEL [--rounds 6] [--against 86124f2] [--prompts 32] [--samples 8]

MODEL: a model folder with its tokenizer (the embedded default's warm-up in ``~/.cache/fasttnt/tiny-warmup-*``).
Prints each way's median seconds per generate and their ratios, and whether the ways sampled the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str, folder: Path):
    """``fasttnt/engines/decode_step.py`` as it was at ``rev``, imported as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:fasttnt/engines/decode_step.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = folder / f"decode_step_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--against", help="a commit whose decode_step.py takes a turn too")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fasttnt.data import build_prompt
    from fasttnt.embedded.synthetic import problems
    from fasttnt.engines import EngineSettings, decode_step, hf

    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = hf.HFEngine(model, tokenizer, EngineSettings(max_new_tokens=args.max_new_tokens))
    if not engine.written_out_step:
        print(f"{args.model}: the written-out step does not support this model", file=sys.stderr)
        return 2
    stream = problems("train", levels=(1, 2, 3, 4), seed=5)
    prompts = [build_prompt(tokenizer, p.problem) for p in itertools.islice(stream, args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        ways = {"this checkout": decode_step, "transformers": None}
        if args.against:
            ways[args.against] = _module_at(args.against, Path(tmp))
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        same = True
        for i in range(args.rounds):
            responses = []
            for name, module in ways.items():
                hf.decode_step = module or decode_step
                engine.written_out_step = module is not None
                start = time.perf_counter()
                batch = engine.generate(prompts, args.samples, seed=i)
                seconds[name].append(time.perf_counter() - start)
                responses.append(batch.responses)
            same &= all(r == responses[0] for r in responses)
        hf.decode_step = decode_step
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, {args.rounds} "
          f"rounds, taking turns")  # fmt: skip
    for name, median in medians.items():
        print(f"{name:<16} {median:.4f} s per generate (median), "
              f"this checkout / it {medians['this checkout'] / median:.3f}")  # fmt: skip
    print(f"the same tokens every round: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
