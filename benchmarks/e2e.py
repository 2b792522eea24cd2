"""One GRPO step of the embedded task through fasttnt and through TRL's GRPOTrainer, side by side in one run.

    python benchmarks/e2e.py [--steps 10] [--warmup-steps 2] [--prompts 32] [--samples 8] [--max-new-tokens 96]

Equal work: the same warmed-up tiny model, the same prompts per step, samples per prompt and length budget, the
same TNT reward (computed by our kernel inside TRL's reward function), the same learning rate and clipping, one
optimizer step per rollout, no KL. The two trainers take turns step by step (after each TRL step, one fasttnt
step), so a shared machine's drift over minutes falls on both alike; each pair of steps gives a ratio. Reports
steps/s, generated tokens/s and trained tokens/s for both (medians over the timed steps, the first
``--warmup-steps`` excluded) and the median of the paired ratios. Needs ``pip install trl``; without it, fasttnt
runs alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def resolved_config(args):
    from fasttnt.config import load_config

    return load_config(
        None,
        [
            f"steps={args.warmup_steps + args.steps}",
            f"save_every={10**6}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.samples}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"cache_dir={args.cache_dir}",
            *args.override,
        ],
    )


class FasttntRun:
    """fasttnt's trainer, one step at a time (``step``), so that its steps can alternate with TRL's."""

    def __init__(self, args, workdir: Path) -> None:
        from fasttnt.trainer import Trainer

        self.args = args
        self.trainer = Trainer(resolved_config(args), workdir / "fasttnt")
        self.rows: list[dict] = []

    def step(self) -> None:
        start = time.perf_counter()
        row = self.trainer.step()
        row["wall"] = time.perf_counter() - start
        self.rows.append(row)

    def summary(self) -> dict:
        self.trainer.verifier.close()
        args, rows = self.args, self.rows
        timed = rows[args.warmup_steps :]
        phases = sorted({k for r in timed for k in r if k.startswith("time_") and k != "time_step"})
        return {
            "step_s": statistics.median(r["wall"] for r in timed),
            "steps_s": [r["wall"] for r in rows],
            # the step's time by phase (medians), and the share of sequences the update left out
            "phases_s": {k.removeprefix("time_"): statistics.median(r.get(k, 0.0) for r in timed) for k in phases},
            "skipped_seq_frac": statistics.median(r.get("skipped_seq_frac", 0.0) for r in timed),
            "generated_tokens": statistics.median(r["len"] * args.prompts * args.samples for r in timed),
            "trained_tokens": statistics.median(r["trained_tokens_per_s"] * r["time_update"] for r in timed),
            "reward_first": rows[0]["reward"],
            "reward_last": rows[-1]["reward"],
        }


def run_trl(args, workdir: Path, after_each_step=None) -> dict:
    """TRL's GRPOTrainer for the same steps; ``after_each_step()`` runs after each step, outside its timing."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fasttnt.data import build_prompt
    from fasttnt.integrations.trl import TNTReward
    from fasttnt.synthetic import problems
    from fasttnt.tiny import warmed_up_model

    cfg = resolved_config(args)  # the very model fasttnt starts from
    _, tokenizer, path = warmed_up_model(Path(cfg.cache_dir), cfg.model.tiny, cfg.warmup)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.padding_side = "left"
    n_problems = args.prompts * (args.warmup_steps + args.steps)
    items = list(itertools.islice(problems("train", seed=0), n_problems))
    dataset = Dataset.from_list(
        [{"prompt": build_prompt(tokenizer, p.problem).text, "answer": p.answer} for p in items]
    )
    # fasttnt's TNT reward as a TRL reward function: the same verifier, limits and values as fasttnt's step
    tnt_reward = TNTReward(tokenizer, args.samples)

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)
            if after_each_step is not None:
                after_each_step()

    logs: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                history.append(dict(logs))

    history = logs
    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type="dapo",  # token-mean over the batch, as fasttnt's default
        max_steps=args.warmup_steps + args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer_class = GRPOTrainer
    if args.trl_loss == "fasttnt":  # TRL's trainer with fasttnt's fused loss and log-probs
        from fasttnt.integrations.trl import FastTNTGRPOTrainer as trainer_class
    trainer = trainer_class(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[tnt_reward],
        args=config,
        train_dataset=dataset,
        callbacks=[StepTimer(), Logs()],
    )
    trainer.train()
    timed = times[args.warmup_steps :]
    lengths = [float(log["completions/mean_length"]) for log in logs][args.warmup_steps :]
    generated = statistics.median(length * args.prompts * args.samples for length in lengths)
    prompt_tokens = statistics.median(len(tokenizer(p)["input_ids"]) for p in dataset["prompt"]) * args.prompts
    return {
        "step_s": statistics.median(timed),
        "steps_s": times,
        "generated_tokens": generated,
        "trained_tokens": generated + prompt_tokens * args.samples,
        "reward_first": float(logs[0]["reward"]),
        "reward_last": float(logs[-1]["reward"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/fasttnt").expanduser()))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument(
        "--trl-loss", choices=("trl", "fasttnt"), default="trl",
        help="TRL's own loss, or TRL's trainer with fasttnt's (fasttnt.integrations.trl)",
    )  # fmt: skip
    parser.add_argument("--trl-only", action="store_true", help="run TRL's trainer alone (benchmarks/trl_loss.py)")
    parser.add_argument(
        "--override",
        nargs="*",
        default=[],
        metavar="key=value",
        help="fasttnt config overrides (the model and warm-up apply to both trainers)",
    )
    args = parser.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed (pip install trl): measuring fasttnt alone", file=sys.stderr)
        trl_available = False
    else:
        trl_available = True

    with tempfile.TemporaryDirectory() as tmp:
        if args.trl_only:
            results = {"trl": run_trl(args, Path(tmp))}
            # the process's peak resident set (Linux: KiB), for benchmarks/trl_loss.py
            results["trl"]["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            print(f"TRL ({args.trl_loss} loss) alone: {results['trl']['step_s']:.3f} s/step")
            return 0
        fasttnt = FasttntRun(args, Path(tmp))
        results = {}
        if trl_available:
            results["trl"] = run_trl(args, Path(tmp), after_each_step=fasttnt.step)
        while len(fasttnt.rows) < args.warmup_steps + args.steps:  # alone (no TRL), or TRL stopped early
            fasttnt.step()
        results = {"fasttnt": fasttnt.summary(), **results}
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, "
        f"median over {args.steps} steps after {args.warmup_steps} warm-up steps, the trainers taking turns"
    )
    print(f"{'':10}{'s/step':>10}{'steps/s':>10}{'gen tok/s':>12}{'train tok/s':>13}{'reward 1st->last':>20}")
    for name, r in results.items():
        print(
            f"{name:10}{r['step_s']:10.3f}{1 / r['step_s']:10.3f}{r['generated_tokens'] / r['step_s']:12.0f}"
            f"{r['trained_tokens'] / r['step_s']:13.0f}{r['reward_first']:10.2f} -> {r['reward_last']:.2f}"
        )
    split = results["fasttnt"]["phases_s"]
    print("fasttnt phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    print(f"fasttnt sequences skipped by the update (median share): {results['fasttnt']['skipped_seq_frac']:.2f}")
    if "trl" in results:
        pairs = list(zip(results["trl"]["steps_s"], results["fasttnt"]["steps_s"], strict=False))
        ratios = [trl_s / fasttnt_s for trl_s, fasttnt_s in pairs[args.warmup_steps :]]
        results["ratio_steps_per_s"] = statistics.median(ratios)
        results["ratio_of_medians"] = results["trl"]["step_s"] / results["fasttnt"]["step_s"]
        print(
            f"fasttnt steps/s / TRL steps/s = {results['ratio_steps_per_s']:.2f} (median of {len(ratios)} step pairs, "
            f"{min(ratios):.2f}-{max(ratios):.2f}; ratio of the medians {results['ratio_of_medians']:.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
