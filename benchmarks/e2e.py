"""One GRPO step of the embedded task through fasttnt and through TRL's GRPOTrainer, side by side in one run.

    python benchmarks/e2e.py [--steps 10] [--warmup-steps 2] [--rounds 3] [--prompts 32] [--samples 8]
                             [--max-new-tokens 96]

Equal work: the same warmed-up tiny model, the same prompts per step, samples per prompt and length budget, the
same TNT reward (computed by our kernel inside TRL's reward function), the same learning rate and clipping, one
optimizer step per rollout, no KL. Reports steps/s, generated tokens/s and trained tokens/s for both and their
ratio (medians over the timed steps, the first ``--warmup-steps`` excluded). A shared machine's speed drifts over
minutes, so the two trainers take turns: ``--rounds`` rounds, each running both from the start (fasttnt first in
even rounds, TRL first in odd ones); each round gives a ratio, and the ratio reported is their median. Needs
``pip install trl``.
"""

from __future__ import annotations

import argparse
import itertools
import json
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


def run_fasttnt(args, workdir: Path) -> dict:
    from fasttnt.trainer import Trainer

    cfg = resolved_config(args)
    trainer = Trainer(cfg, workdir / "fasttnt")
    rows = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        row = trainer.step()
        row["wall"] = time.perf_counter() - start
        rows.append(row)
    trainer.verifier.close()
    timed = rows[args.warmup_steps :]
    phases = sorted({k for r in timed for k in r if k.startswith("time_") and k != "time_step"})
    return {
        "step_s": statistics.median(r["wall"] for r in timed),
        # the step's time by phase (medians), and the share of sequences the update left out
        "phases_s": {k.removeprefix("time_"): statistics.median(r.get(k, 0.0) for r in timed) for k in phases},
        "skipped_seq_frac": statistics.median(r.get("skipped_seq_frac", 0.0) for r in timed),
        "generated_tokens": statistics.median(r["len"] * args.prompts * args.samples for r in timed),
        "trained_tokens": statistics.median(r["trained_tokens_per_s"] * r["time_update"] for r in timed),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
    }


def run_trl(args, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fasttnt.data import build_prompt
    from fasttnt.rewards import PackedResponses, RewardConfig, compute_rewards
    from fasttnt.rollout import decode_responses, pack
    from fasttnt.synthetic import problems
    from fasttnt.tiny import warmed_up_model
    from fasttnt.verify import verify_batch

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
    think_end = tokenizer.convert_tokens_to_ids("</think>")

    def tnt_reward(completions, answer, completion_ids, **_):
        # TRL decodes without special tokens, and </think> is one here: judge our own decoding of the ids
        texts = decode_responses(tokenizer, completion_ids)
        correct = torch.tensor(list(verify_batch(texts, answer, require_think_end=True)))
        ids, cu = pack(completion_ids)
        batch = PackedResponses(ids, cu, torch.zeros(len(completions), dtype=torch.bool), args.samples)
        return compute_rewards(batch, correct, think_end, RewardConfig()).rewards.tolist()

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

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
    trainer = GRPOTrainer(
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
        "generated_tokens": generated,
        "trained_tokens": generated + prompt_tokens * args.samples,
        "reward_first": float(logs[0]["reward"]),
        "reward_last": float(logs[-1]["reward"]),
    }


def _median_round(runs: list[dict]) -> dict:
    """The run whose step time is the median of ``runs`` (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="turns of both trainers (the ratio: their median)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/fasttnt").expanduser()))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
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

    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    runners = {"fasttnt": run_fasttnt, **({"trl": run_trl} if trl_available else {})}
    rounds: list[dict[str, dict]] = []
    for turn in range(args.rounds):
        order = list(runners) if turn % 2 == 0 else list(reversed(runners))
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append({name: runners[name](args, Path(tmp)) for name in order})
        if trl_available:
            ratio = rounds[-1]["trl"]["step_s"] / rounds[-1]["fasttnt"]["step_s"]
            print(f"round {turn + 1}/{args.rounds} ({' then '.join(order)}): ratio {ratio:.2f}", file=sys.stderr)
    # per trainer, the round whose step time is the median one (its phases and tokens go with it)
    results = {name: _median_round([r[name] for r in rounds]) for name in runners}
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, "
        f"median over {args.steps} steps after {args.warmup_steps} warm-up steps, the median of {args.rounds} rounds"
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
        ratios = [r["trl"]["step_s"] / r["fasttnt"]["step_s"] for r in rounds]
        results["ratio_steps_per_s"] = statistics.median(ratios)
        results["ratio_by_round"] = ratios
        print(
            f"fasttnt steps/s / TRL steps/s = {results['ratio_steps_per_s']:.2f} (median of {len(ratios)} rounds: "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + ")"
        )
    results["rounds"] = rounds
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
