"""fasttnt's GRPO step against TRL's GRPOTrainer at equal work, side by side in one run: time and memory.

    python benchmarks/e2e.py [--steps 10] [--warmup-steps 2] [--prompts 32] [--samples 8] [--max-new-tokens 96]
    python benchmarks/e2e.py --model FOLDER --prompt-file FILE [...]   # a real-shaped model (qwen_standin.py)

Equal work: the same model (the embedded task's warmed-up tiny model, or ``--model``'s folder with the problems of
``--prompt-file``, a local JSONL of ``problem``/``answer`` rows), the same prompts per step (fasttnt's prompt for
each problem), samples per prompt and length budget, the same TNT reward (fasttnt's, inside TRL's reward
function), the same learning rate and clipping, one optimizer step per rollout, token-mean loss, no KL.

Each trainer runs in a process of its own and the two take turns step by step (TRL first on even steps, fasttnt
first on odd ones), so a shared machine's drift over minutes falls on both alike, each pair of steps gives a ratio,
and each process's memory is its own. Reports, per trainer, medians over the timed steps (the first ``--warmup-steps``
excluded): s/step, generated and trained tokens/s, the update's peak resident set (its high-water mark from the
update's first forward to the end of its optimizer step: fasttnt's ``Actor.update``, TRL's ``compute_loss`` to
``on_step_end``), how far that peak rose above the resident set at the update's start, and the process's peak
resident set over the run. The peaks are the kernel's (``VmHWM`` in /proc, reset through ``clear_refs``): Linux.
A model with random weights (the stand-in) earns no reward, so every advantage is 0 and fasttnt's update leaves
every sequence out (``loss.skip_zero_advantage``); TRL's computes them all: for an update of equal work there, pass
``--override loss.skip_zero_advantage=false``.
Needs ``pip install trl``; without it, fasttnt runs alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import proc_memory
import torch

# -- the work both trainers do ------------------------------------------------------------------------------------


def resolved_config(args):
    from fasttnt.config import load_config

    model = [f"model.name={args.model}", f"data.train={args.prompt_file}"] if args.model else []
    return load_config(
        None,
        [
            f"steps={args.warmup_steps + args.steps}",
            f"save_every={10**6}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.samples}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"cache_dir={args.cache_dir}",
            *model,
            *args.override,
        ],
    )


def _problems(args) -> list:
    """The problems TRL's dataset holds: as many as its steps take, from the same source as fasttnt's."""
    n = args.prompts * (args.warmup_steps + args.steps)
    if args.model:
        from fasttnt.data import load_problems

        return list(itertools.islice(itertools.cycle(load_problems(args.prompt_file)), n))
    from fasttnt.embedded.synthetic import problems

    return list(itertools.islice(problems("train", seed=0), n))


def model_folder(args, cfg) -> str:
    if args.model:
        return args.model
    from fasttnt.embedded.tiny import warmed_up_model

    return str(warmed_up_model(Path(cfg.cache_dir), cfg.model.tiny, cfg.warmup)[2])  # fasttnt's start, cached


def _update_window(peaks: proc_memory.Peaks) -> dict[str, float]:
    window = peaks.end_window()
    return {"update_peak_mib": window["peak_mib"], "update_rise_mib": window["rise_mib"]}


# -- the trainers, each in its own process, one step per "step" message ----------------------------------------------


def use_checkout(source: Path, args, workdir: Path):
    """Import fasttnt from the checkout at ``source`` (its root) instead of the installed one, and start it from
    the same model as every other trainer of the run (``args.start_model``): a cache of its own under ``workdir``
    holds a link to that model at the key the checkout's own recipe hashes to (the user's cache stays untouched).
    Returns the arguments with that cache."""
    sys.path[:0] = [str(source), str(source / "kernels")]  # ahead of the installed (editable) fasttnt
    import fasttnt

    if not Path(fasttnt.__file__).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"e2e.py: fasttnt was imported from {fasttnt.__file__}, not from the checkout {source}")
    args = argparse.Namespace(**{**vars(args), "cache_dir": str(workdir / "cache")})
    if not args.model:
        try:
            from fasttnt.embedded.tiny import warmup_cache_path
        except ImportError:  # before the embedded default moved into its own package (2a97e2f)
            from fasttnt.tiny import warmup_cache_path
        cfg = resolved_config(args)
        entry = warmup_cache_path(Path(cfg.cache_dir), cfg.model.tiny, cfg.warmup)
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.symlink_to(Path(args.start_model).resolve(), target_is_directory=True)
    return args


def fasttnt_worker(args, workdir: Path, conn, source: Path | None = None) -> None:
    """``source``: a checkout to run instead of the installed fasttnt (``use_checkout``; e2e_commits.py)."""
    if source is not None:
        args = use_checkout(source, args, workdir)
    from fasttnt.trainer import Trainer

    trainer = Trainer(resolved_config(args), workdir / "run", progress=False)
    peaks, update_peaks = proc_memory.Peaks(), []
    update = trainer.actor.update

    def measured_update(*a, **k):  # this instance's update, inside a memory window
        peaks.start_window()
        try:
            return update(*a, **k)
        finally:
            update_peaks.append(_update_window(peaks))

    trainer.actor.update = measured_update
    while conn.recv() == "step":
        start = time.perf_counter()
        row = trainer.step()
        row["wall"] = time.perf_counter() - start
        row["trained_tokens"] = row["trained_tokens_per_s"] * row["time_update"]
        row["generated_tokens"] = row["len"] * args.prompts * args.samples  # len: the mean response length
        conn.send({**row, **update_peaks[-1]})
    trainer.verifier.close()
    conn.send({"peak_rss_mib": peaks.run_peak()})


def trl_worker(args, workdir: Path, conn) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fasttnt.integrations.trl import TNTReward
    from fasttnt.run_setup import training_prompt

    cfg = resolved_config(args)
    folder = model_folder(args, cfg)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    rows = [{"prompt": training_prompt(cfg, tokenizer, p).text, "answer": p.answer} for p in _problems(args)]
    dataset = Dataset.from_list(rows)
    prompt_tokens = statistics.median(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    peaks, step = proc_memory.Peaks(), {}

    class Turns(TrainerCallback):
        """Waits for its turn before each step; times the step and its update; reports once the step is logged."""

        def on_step_begin(self, *a, **k):
            if conn.recv() != "step":
                raise RuntimeError("e2e.py: TRL's process was stopped before its last step")
            step.clear()
            step["start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            step["wall"] = time.perf_counter() - step["start"]
            step.update(_update_window(peaks))

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                generated = float(logs["completions/mean_length"]) * args.prompts * args.samples
                row = {key: step[key] for key in ("wall", "update_peak_mib", "update_rise_mib")}
                trained = generated + prompt_tokens * args.prompts * args.samples
                conn.send(
                    {**row, "generated_tokens": generated, "trained_tokens": trained, "reward": float(logs["reward"])}
                )

    config = GRPOConfig(
        output_dir=str(workdir / "run"),
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
        reward_funcs=[TNTReward(tokenizer, args.samples)],  # fasttnt's verifier, limits and values
        args=config,
        train_dataset=dataset,
        callbacks=[Turns()],
    )
    compute_loss = trainer.compute_loss

    def measured_compute_loss(*a, **k):  # the update starts at the loss's forward (after generation and scoring)
        if "update" not in step:
            step["update"] = True
            peaks.start_window()
        return compute_loss(*a, **k)

    trainer.compute_loss = measured_compute_loss
    trainer.train()
    if conn.recv() == "stop":
        conn.send({"peak_rss_mib": peaks.run_peak()})


WORKERS = {"trl": trl_worker, "fasttnt": fasttnt_worker}


def run_turns(args, workers: dict[str, Callable]) -> dict[str, dict]:
    """Each of ``workers`` (a name: a worker function, ``WORKERS``'s or a ``functools.partial`` of one) in a process
    of its own, one step each in turn, the order reversed every other step (so that no trainer always follows the
    same one); their step rows and final peaks, by name."""
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: nothing of one trainer in the other's memory
    total = args.warmup_steps + args.steps
    names = list(workers)
    with tempfile.TemporaryDirectory() as tmp:
        procs, conns, rows = {}, {}, {name: [] for name in names}
        for i, name in enumerate(names):
            conns[name], child = ctx.Pipe()
            workdir = Path(tmp) / f"worker{i}"  # names may hold characters a folder's should not
            workdir.mkdir()
            # not daemonic: fasttnt's verifier and TRL's reward start worker processes of their own
            procs[name] = ctx.Process(target=workers[name], args=(args, workdir, child))
            procs[name].start()

        def ask(name: str, message: str) -> dict:
            conns[name].send(message)
            try:
                return conns[name].recv()
            except EOFError:
                procs[name].join()
                raise SystemExit(f"e2e.py: {name}'s process died (exit code {procs[name].exitcode})") from None

        try:
            for i in range(total):
                for turn, name in enumerate(names if i % 2 == 0 else names[::-1]):
                    rows[name].append({**ask(name, "step"), "turn": turn})
                walls = ", ".join(f"{name} {rows[name][-1]['wall']:.2f} s" for name in names)
                print(f"step {i + 1}/{total}{' (warm-up)' if i < args.warmup_steps else ''}: {walls}", file=sys.stderr)
            finals = {name: ask(name, "stop") for name in names}
        finally:
            for proc in procs.values():
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.terminate()
    return {name: summarise(args, rows[name], finals[name]) for name in names}


def summarise(args, rows: list[dict], final: dict) -> dict:
    timed = rows[args.warmup_steps :]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    out = {
        "step_s": med("wall"),
        "steps_s": [r["wall"] for r in rows],
        "generated_tokens": med("generated_tokens"),
        "trained_tokens": med("trained_tokens"),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "update_peak_mib": med("update_peak_mib"),
        "update_rise_mib": med("update_rise_mib"),
        "peak_rss_mib": final["peak_rss_mib"],
        "went_first": sum(r["turn"] == 0 for r in rows),  # steps in which this trainer took the first turn
    }
    if "time_update" in timed[0]:  # fasttnt's own split: the step's time by phase, the sequences the update skipped
        phases = sorted({k for r in timed for k in r if k.startswith("time_") and k != "time_step"})
        out["phases_s"] = {k.removeprefix("time_"): statistics.median(r.get(k, 0.0) for r in timed) for k in phases}
        out["skipped_seq_frac"] = med("skipped_seq_frac")
    return out


def report(args, results: dict) -> None:
    work = f"{args.model} (prompts: {args.prompt_file})" if args.model else "the embedded task's tiny model"
    print(
        f"\n{work}: {args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, "
        f"median over {args.steps} steps after {args.warmup_steps} warm-up steps, the trainers taking turns"
    )
    head = ("s/step", "steps/s", "gen tok/s", "train tok/s", "update peak MiB", "update rise MiB", "peak MiB")
    print(f"{'':10}" + "".join(f"{h:>16}" for h in head) + f"{'reward 1st->last':>20}")
    for name, r in results.items():
        values = (f"{r['step_s']:.3f}", f"{1 / r['step_s']:.3f}", f"{r['generated_tokens'] / r['step_s']:.0f}",
                  f"{r['trained_tokens'] / r['step_s']:.0f}", f"{r['update_peak_mib']:.0f}",
                  f"{r['update_rise_mib']:.0f}", f"{r['peak_rss_mib']:.0f}")  # fmt: skip
        print(
            f"{name:10}" + "".join(f"{v:>16}" for v in values) + f"{r['reward_first']:10.2f} -> {r['reward_last']:.2f}"
        )
    if "fasttnt" in results:
        split = results["fasttnt"]["phases_s"]
        print("fasttnt phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
        print(f"fasttnt sequences skipped by the update (median share): {results['fasttnt']['skipped_seq_frac']:.2f}")


def compare(args, results: dict) -> None:
    """The paired ratios, into ``results`` and printed."""
    trl, fast = results["trl"], results["fasttnt"]
    ratios = [t / f for t, f in zip(trl["steps_s"], fast["steps_s"], strict=True)][args.warmup_steps :]
    results["ratio_steps_per_s"] = statistics.median(ratios)
    results["ratio_of_medians"] = trl["step_s"] / fast["step_s"]
    results["ratio_update_peak"] = fast["update_peak_mib"] / trl["update_peak_mib"]
    results["ratio_peak_rss"] = fast["peak_rss_mib"] / trl["peak_rss_mib"]
    print(
        f"fasttnt steps/s / TRL steps/s = {results['ratio_steps_per_s']:.2f} (median of {len(ratios)} step pairs, "
        f"{min(ratios):.2f}-{max(ratios):.2f}; ratio of the medians {results['ratio_of_medians']:.2f})"
    )
    print(
        f"fasttnt / TRL peak memory: during the update {results['ratio_update_peak']:.2f}, "
        f"over the run {results['ratio_peak_rss']:.2f}"
    )


def parser() -> argparse.ArgumentParser:
    """The options, also e2e_commits.py's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--model", help="a model folder (benchmarks/qwen_standin.py) instead of the tiny model")
    parser.add_argument("--prompt-file", help="with --model: a local JSONL of problem/answer rows")
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
    return parser


def check(options: argparse.ArgumentParser, args) -> None:
    """Exits through ``options.error`` on options that cannot go together or cannot be measured here."""
    if bool(args.model) != bool(args.prompt_file):
        options.error("--model and --prompt-file go together (the model's folder and a local JSONL of problems)")
    if args.steps < 1 or args.warmup_steps < 0:
        options.error("--steps must be >= 1 and --warmup-steps >= 0")
    if not proc_memory.available():
        options.error("the memory columns read the kernel's high-water marks from /proc: Linux only")


def main(argv: list[str] | None = None) -> int:
    options = parser()
    args = options.parse_args(argv)
    check(options, args)
    try:
        import trl  # noqa: F401
    except ImportError:
        if args.trl_only:
            options.error("--trl-only: TRL is not installed (pip install trl)")
        print("TRL is not installed (pip install trl): measuring fasttnt alone", file=sys.stderr)
        names = ["fasttnt"]
    else:
        names = ["trl"] if args.trl_only else ["trl", "fasttnt"]
    model_folder(args, resolved_config(args))  # the tiny model's warm-up once, here, before both trainers load it

    results = run_turns(args, {name: WORKERS[name] for name in names})
    report(args, results)
    if len(results) == 2:
        compare(args, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
