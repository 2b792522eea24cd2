"""The rollout of a training step through each engine, side by side: the same prompts, group size, length budget and
sampling (the embedded default's, or a config's), the engines taking turns round by round in one process.

    python benchmarks/rollout_engines.py [--engines hf,vllm] [--rounds 7] [overrides ...]
    python benchmarks/rollout_engines.py --json out.json    # the per-round numbers too
    python benchmarks/rollout_engines.py --engines hf,hf-transformers   # the written-out decode step against none

Reports generated tokens per second (the median over the rounds and their spread), and per engine the mean response
length. For the hf engine also where its time goes: the model's forwards (prefill and decode steps), the sampler
(``engines/sampler.py``), and the rest (cache bookkeeping, stops); ``generate / forward`` is what a decode loop
costs over the model alone (the forwards: transformers' and the written-out decode steps,
``engines/decode_step.py``; ``hf-transformers`` is the hf engine decoding through transformers' forward alone). Each
round's prompts are the next ``rollout.prompts_per_step`` of the training stream; the first round is a warm-up that
is not counted (vLLM's first generate is slow). The vllm engine needs vLLM (on a CPU its CPU build, float32, eager
mode); the hf engine generates with the model itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, hf-transformers, vllm")
    parser.add_argument("--rounds", type=int, default=7, help="counted rounds per engine (after one warm-up round)")
    parser.add_argument("--config", help="a YAML config (default: the embedded tiny setup)")
    parser.add_argument("--json", help="write every round's numbers here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]

    from fasttnt import host_memory
    from fasttnt.config import load_config
    from fasttnt.distributed import local_device
    from fasttnt.engines.sampler import step_seed
    from fasttnt.run_setup import engine_settings, load_policy, prompt_budget_of, training_prompt
    from fasttnt.stream import ProblemStream

    cfg = load_config(args.config, args.overrides)
    r = cfg.rollout
    device = local_device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, path = load_policy(cfg, device)
    model.to(device).eval()
    # the training run's engine, as built, but awake throughout: the vllm one is built without the model (it serves
    # the checkpoint it loads), and a level-2 sleep would discard weights it could not be given back
    give_back_heap = host_memory.worth_it(model, device)  # as the training run decides it
    settings = engine_settings(cfg, path, device, prompt_budget_of(cfg), give_back_heap=give_back_heap)
    settings = replace(settings, sleep_between_rollouts=False)
    built = {name: _build(name, model, tokenizer, settings) for name in engines}

    stream = ProblemStream(cfg)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for i in range(args.rounds + 1):
        prompts = [training_prompt(cfg, tokenizer, p) for p in stream.take(r.prompts_per_step)]
        order = list(built.items()) if i % 2 == 0 else list(built.items())[::-1]
        for name, engine in order:  # the engines take turns on the same prompts, the first of them alternating
            timers = _HFTimers(model) if name.startswith("hf") else None
            start = time.perf_counter()
            with timers or contextlib.nullcontext():
                batch = engine.generate(prompts, r.group_size, seed=step_seed(cfg.seed, i))
            seconds = time.perf_counter() - start
            if i > 0:
                tokens = batch.response_ids.numel()
                row = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
                if timers is not None:
                    row |= {"forward_s": timers.forward, "sample_s": timers.sample}
                rounds[name].append(row)
    for engine in built.values():
        engine.close()

    print(f"rollout of {r.prompts_per_step} prompts x {r.group_size} samples, <= {r.max_new_tokens} new tokens, "
          f"temperature {r.temperature}; {args.rounds} rounds per engine, taking turns")  # fmt: skip
    print(f"{'engine':<16}{'tokens/s median':>18}{'min':>10}{'max':>10}{'mean length':>14}")
    for name, rows in rounds.items():
        rates = [row["tokens_per_s"] for row in rows]
        length = sum(row["tokens"] for row in rows) / (len(rows) * r.prompts_per_step * r.group_size)
        print(f"{name:<16}{statistics.median(rates):>18.0f}{min(rates):>10.0f}{max(rates):>10.0f}{length:>14.1f}")
    if "hf" in rounds:
        rows = rounds["hf"]
        share = {k: statistics.median(row[k] / row["seconds"] for row in rows) for k in ("forward_s", "sample_s")}
        ratio = statistics.median(row["seconds"] / row["forward_s"] for row in rows)
        print(f"hf: forwards {100 * share['forward_s']:.1f}%, sampling {100 * share['sample_s']:.1f}%, the rest "
              f"{100 * (1 - share['forward_s'] - share['sample_s']):.1f}% of generate; generate / forward "
              f"{ratio:.3f} (medians over the rounds)")  # fmt: skip
    if len(rounds) == 2:
        a, b = (statistics.median(row["tokens_per_s"] for row in rows) for rows in rounds.values())
        print(f"ratio {engines[1]} / {engines[0]}: {b / a:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"engines": engines, "rounds": rounds}, indent=1))
    return 0


def _build(name: str, model, tokenizer, settings):
    from fasttnt.engines import build_engine

    if name == "hf-transformers":  # the hf engine, every decode step through transformers' forward
        engine = build_engine("hf", model, tokenizer, settings)
        engine.written_out_step = False
        return engine
    return build_engine(name, None if name == "vllm" else model, tokenizer, settings)


class _HFTimers:
    """Seconds spent in the model's forwards (transformers' and the written-out decode steps) and in the sampler
    while the hf engine generates (wrapping them)."""

    def __init__(self, model) -> None:
        self.model, self.forward, self.sample = model, 0.0, 0.0

    def _timed(self, fn, field: str):
        def run(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()  # on CUDA the kernels' own time, not their launches
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return run

    def __enter__(self):
        import fasttnt.engines.hf as hf

        self._sampler, self._own_forward = hf.seeded_sample, vars(self.model).get("forward")
        self._step = hf.decode_step.step
        hf.seeded_sample = self._timed(hf.seeded_sample, "sample")
        hf.decode_step.step = self._timed(hf.decode_step.step, "forward")
        self.model.forward = self._timed(self.model.forward, "forward")
        return self

    def __exit__(self, *exc) -> None:
        import fasttnt.engines.hf as hf

        hf.seeded_sample, hf.decode_step.step = self._sampler, self._step
        if self._own_forward is None:
            del self.model.forward  # the class's forward again
        else:
            self.model.forward = self._own_forward  # what the instance had (a hook, a compiled forward)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
