"""The ``fasttnt`` command."""

from __future__ import annotations

import argparse
import os
import sys

from .eval_settings import BENCHMARK_ORDER, MATH_MAX_NEW_TOKENS, EvalSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fasttnt", description="GRPO for hybrid reasoning models with the TNT reward")
    # the deepspeed launcher puts --local_rank=N before the command; torchrun sets LOCAL_RANK (read from the env)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
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
    train.add_argument(
        "--variant",
        help="a named variant applied over the config, before the overrides: SCHEME[+ALGORITHM][:key=value,...], "
        "e.g. tnt+dapo, tnt+drgrpo, tnt:omega=1 (fasttnt.variants)",
    )
    train.add_argument("--variants-file", help="YAML of your own variants for --variant: name: {dotted.key: value}")
    train.add_argument("--output-dir", default="runs/train", help="where config, metrics, checkpoints go")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    train.add_argument(
        "--resume-with-new-config",
        action="store_true",
        help="--resume even when the config changes keys that the checkpoint depends on (model, group size, ...)",
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=10")
    ev = commands.add_parser(
        "eval",
        help="accuracy, tokens, TE, non-thinking ratio and hack rate of models on benchmarks",
        description="Evaluates each --model on each benchmark and writes eval.json, eval.md and eval.png; "
        "finished (model, benchmark) results are kept, so a rerun with the same --output-dir skips them.",
    )
    # the defaults are EvalSettings' (fasttnt.eval_settings), shown by --help
    defaults = EvalSettings()
    ev.add_argument("--model", action="append", required=True, help="a local HF folder or hub id (repeatable)")
    ev.add_argument(
        "--benchmarks",
        default=",".join(BENCHMARK_ORDER),
        help=f"comma-separated: synthetic, {', '.join(BENCHMARK_ORDER)}, or local files (default: all but synthetic)",
    )
    ev.add_argument("--samples", type=int, default=defaults.samples,
                    help="samples per problem; accuracy is their mean, pass@1 (default: %(default)s)")  # fmt: skip
    ev.add_argument("--mode", choices=["free", "thinking", "non-thinking"], default=defaults.mode,
                    help="free: the model chooses; the others force a mode (default: %(default)s)")  # fmt: skip
    ev.add_argument(
        "--prompt-style", choices=["plain", "ellipsis"], default=defaults.prompt_style,
        help="ellipsis: AutoThink's prompt, <think> followed by '...' (as data.prompt_style in training; default: "
        "%(default)s)",
    )  # fmt: skip
    ev.add_argument("--engine", choices=["hf", "vllm"], default=defaults.engine, help="default: %(default)s")
    ev.add_argument("--temperature", type=float, default=defaults.temperature, help="default: %(default)s")
    ev.add_argument("--top-p", type=float, default=defaults.top_p, help="default: %(default)s")
    ev.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"default: {defaults.max_new_tokens} for synthetic, else {MATH_MAX_NEW_TOKENS}")  # fmt: skip
    ev.add_argument("--synthetic-per-level", type=int, default=defaults.synthetic_per_level,
                    help="held-out synthetic problems per level (default: %(default)s)")  # fmt: skip
    ev.add_argument("--level-weights", default="",
                    help="the synthetic split's mix of levels 1-4, e.g. 0.7,0.1,0.1,0.1: its problems per level times "
                         "4, shared out by these weights (default: the same number of each)")  # fmt: skip
    ev.add_argument("--limit", type=int, default=defaults.limit,
                    help="at most this many problems per benchmark (default: all)")  # fmt: skip
    ev.add_argument("--seed", type=int, default=defaults.seed, help="default: %(default)s")
    ev.add_argument("--output-dir", default="runs/eval", help="default: %(default)s")
    ev.add_argument("--save-responses", action="store_true", help="write every response as jsonl")
    cmp = commands.add_parser(
        "compare",
        help="train the embedded model with each reward scheme and variant and compare them (the TNT paper in "
        "miniature, and what it left open)",
        description="From shared warm-ups, trains the embedded model with each variant (same steps, seeds and "
        "prompts), evaluates each on the synthetic held-out split, and writes compare.json (every run), compare.md "
        "(mean ± standard error over runs) and compare.png. Finished runs are kept, so a rerun with the same "
        "--output-dir skips them. A variant is SCHEME[+ALGORITHM][:key=value,...], e.g. tnt, tnt+dapo, "
        "tnt+drgrpo, tnt:omega=1, uniform-limit:cap=64 (fasttnt.variants).",
    )
    cmp.add_argument(
        "--variants", "--schemes", dest="variants", default="tnt,no-limit,uniform-limit,binary",
        help="comma-separated variants (default: the four reward schemes)",
    )  # fmt: skip
    cmp.add_argument("--variants-file", help="YAML of your own variants: name: {dotted.key: value, ...}")
    cmp.add_argument("--seeds", type=int, default=2, help="training seeds per warm-up")
    cmp.add_argument("--first-seed", type=int, default=0, help="the first training seed (default: %(default)s)")
    cmp.add_argument("--warmup-seeds", type=int, default=1, help="warm-ups, each from its own seed")
    cmp.add_argument("--steps", type=int, default=80, help="GRPO steps per run")
    cmp.add_argument("--uniform-limit", type=float, default=32.0, help="the uniform-limit scheme's cap, in tokens")
    cmp.add_argument("--samples", type=int, default=4, help="evaluation samples per held-out problem")
    cmp.add_argument("--eval-per-level", type=int, default=50, help="held-out problems per level of the embedded "
                     "task (level 1 has 10); fewer: a quick, noisier comparison (default: %(default)s)")  # fmt: skip
    cmp.add_argument("--temperatures", default="0.6", help="comma-separated evaluation temperatures; the first's "
                     "report is compare.md, each other's compare_T<t>.md (0.6,1.0: eval's and training's)")  # fmt: skip
    cmp.add_argument("--eval-steps", default="", help="comma-separated steps whose models are evaluated, a run's "
                     "numbers the mean over them, e.g. 50,60,70,80 (default: the final model alone)")  # fmt: skip
    cmp.add_argument("--jobs", type=int, default=None, help="runs at once, one process each (default: one per core, "
                     "at most 8)")  # fmt: skip
    cmp.add_argument("--output-dir", default="runs/compare")
    cmp.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides (all runs)")
    args = parser.parse_args(argv)

    if args.command == "compare":
        return _compare(args)
    if args.command == "train":
        return _train(args)
    if args.command == "eval":
        return _eval(args)

    if args.command == "selfcheck":
        # imported here: the kernel package picks compiled or interpreted Triton when it is first imported
        from fasttnt_kernels.selfcheck import main as selfcheck

        return selfcheck(["--quick"] if args.quick else [])
    parser.error(f"unknown command {args.command!r}")
    return 2


def _train(args) -> int:
    import time
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from . import distributed
    from .checkpoint import ResumeError
    from .config import ConfigError, load_config
    from .data import DataError
    from .guard import StaleWeightsError
    from .pipeline.peer import PipelineError, worker_name
    from .pipeline.roles import is_worker_rank
    from .pipeline.worker import serve
    from .plots import summary_table
    from .preemption import EXIT_PREEMPTED, Preempted
    from .rollouts import VerificationError
    from .trainer import Trainer
    from .variants import VariantError, read_variants_file, variant_overrides
    from .verify import VerifierStartupError

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"fasttnt train: config error: {err}", file=sys.stderr)
        return 2
    if args.variant:
        try:
            mine = read_variants_file(args.variants_file) if args.variants_file else None
            variant = variant_overrides(args.variant, cfg, mine)
            cfg = load_config(args.config, [*variant, *args.overrides])  # the user's overrides have the last word
        except VariantError as err:
            print(f"fasttnt train: {err}" if str(err).startswith("--") else f"fasttnt train: --variant {err}",
                  file=sys.stderr)  # fmt: skip
            return 2
        except ConfigError as err:
            print(f"fasttnt train: config error: --variant {args.variant}: {err}", file=sys.stderr)
            return 2
    problem = _not_creatable("--output-dir", args.output_dir)
    if problem:
        print(f"fasttnt train: {problem}", file=sys.stderr)
        return 2
    if cfg.logging.wandb:  # before any work: a run that cannot log where it was asked to does not start
        from .wandb_log import WandbMissing, import_wandb

        try:
            import_wandb()
        except WandbMissing as err:
            print(f"fasttnt train: {err}", file=sys.stderr)
            return 2
    hf_logging.disable_progress_bar()  # our bars say what is happening; its per-file bars only add noise

    def run() -> int:
        start = time.perf_counter()
        resume = args.resume or args.resume_with_new_config
        if is_worker_rank(cfg):  # a rank that only generates (rollout.workers)
            try:
                return serve(cfg, Path(args.output_dir), resume=resume)
            except ConfigError as err:
                print(f"fasttnt train: config error: {err}", file=sys.stderr)
                return 2
            except (PipelineError, StaleWeightsError, VerificationError, VerifierStartupError) as err:
                print(f"fasttnt train: {worker_name(distributed.launch_rank())}: {err}", file=sys.stderr)
                return 1
        try:
            trainer = Trainer(cfg, Path(args.output_dir), resume=resume, new_config_ok=args.resume_with_new_config)
        except ConfigError as err:
            print(f"fasttnt train: config error: {err}", file=sys.stderr)
            return 2
        except (DataError, FileExistsError, ResumeError) as err:
            print(f"fasttnt train: {err}", file=sys.stderr)
            return 2
        except PipelineError as err:  # the rollout worker died or hung before the first step
            print(f"fasttnt train: {err}", file=sys.stderr)
            return 1
        try:
            history = trainer.run()
        except (VerificationError, VerifierStartupError, StaleWeightsError, PipelineError) as err:
            print(f"fasttnt train: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # the second SIGINT (or SIGTERM): at once, without a checkpoint
            print("fasttnt train: interrupted; the newest checkpoint is what --resume continues", file=sys.stderr)
            return 130
        except Preempted as stop:
            if trainer.parts.is_main:
                args_again = [a for a in sys.argv[2:] if a not in ("--resume", "--resume-with-new-config")]
                again = " ".join(["fasttnt train --resume", *args_again]) if sys.argv[1:2] == ["train"] else ""
                print(
                    f"fasttnt train: {stop}; continue with: {again or 'the same command and --resume'}",
                    file=sys.stderr,
                )
            # a rollout worker is mid-batch, not at the shutdown's barrier: the launcher ends it when this rank exits
            if distributed.launched_distributed() and trainer.parts.pipeline is None:
                distributed.shutdown()
            return EXIT_PREEMPTED
        if trainer.parts.is_main:
            print()
            print(summary_table(history))
            print(
                f"\nwall time {time.perf_counter() - start:.0f} s; outputs in {args.output_dir}: config.yaml, "
                "metrics.jsonl, checkpoints/, final/, curves.png"
            )
        if distributed.launched_distributed():
            distributed.shutdown()
        return 0

    if distributed.launched_distributed():
        distributed.exit_process(distributed.fail_fast(run))  # a failing rank ends the job, not hangs the others
    return run()


def _compare(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from .compare import RUN_KEYS, CompareSettings, default_jobs, run_compare
    from .config import ConfigError, load_config
    from .variants import VariantError, check_variant, read_variants_file, split_variants

    variants = tuple(dict.fromkeys(split_variants(args.variants)))
    problems = [] if variants else ["--variants is empty"]
    problems += [
        f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}"
        for name in ("seeds", "warmup_seeds", "steps", "samples", "eval_per_level", "jobs")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    if not args.uniform_limit >= 0:
        problems.append(f"--uniform-limit: must be >= 0, got {args.uniform_limit}")
    if args.first_seed < 0:
        problems.append(f"--first-seed: must be >= 0, got {args.first_seed}")
    try:
        eval_steps = tuple(sorted({int(t) for t in args.eval_steps.split(",") if t.strip()}))
    except ValueError:
        eval_steps = (0,)
    if not all(1 <= t <= args.steps for t in eval_steps):
        problems.append(
            f"--eval-steps: comma-separated steps from 1 to --steps ({args.steps}), got {args.eval_steps!r}"
        )
    try:
        temperatures = tuple(dict.fromkeys(float(t) for t in args.temperatures.split(",") if t.strip()))
    except ValueError:
        temperatures = ()
    if not temperatures or not all(t > 0 for t in temperatures):
        problems.append(f"--temperatures: comma-separated numbers > 0, got {args.temperatures!r}")
    user_variants = None
    level_weights = None
    try:
        # check the overrides before hours of training; their data.level_weights is the held-out split's mix too
        data = load_config(None, args.overrides).data
        level_weights = data.level_weights
        if level_weights is not None and tuple(data.levels) != (1, 2, 3, 4):
            problems.append(
                f"data.level_weights: the held-out split has levels 1-4, and data.levels is {list(data.levels)}; "
                "give data.levels=[1,2,3,4] with a mix for both"
            )
        user_variants = read_variants_file(args.variants_file) if args.variants_file else None
        for variant in variants:  # and every variant on top of them
            check_variant(
                variant,
                [*args.overrides, f"reward.uniform_limit={args.uniform_limit}"],
                user_variants,
                reserved=RUN_KEYS,
            )
    except VariantError as err:  # before ConfigError, of which it is a kind
        problems.append(f"--variants: {err}" if not str(err).startswith("--") else str(err))
    except ConfigError as err:
        problems.append(f"config error: {err}")
    if not problems:
        problems = [p for p in [_not_creatable("--output-dir", args.output_dir)] if p]
    if problems:
        print(f"fasttnt compare: {problems[0]}", file=sys.stderr)
        return 2
    hf_logging.disable_progress_bar()
    base = CompareSettings()
    settings = replace(
        base,
        variants=variants,
        seeds=args.seeds,
        first_seed=args.first_seed,
        warmup_seeds=args.warmup_seeds,
        steps=args.steps,
        uniform_limit=args.uniform_limit,
        jobs=args.jobs or default_jobs(),
        eval=replace(
            base.eval,
            samples=args.samples,
            synthetic_per_level=args.eval_per_level,
            synthetic_level_weights=level_weights,
            temperature=temperatures[0] if temperatures else 0.6,
        ),
        temperatures=temperatures[1:],
        eval_steps=eval_steps,
    )
    out = Path(args.output_dir)
    summary = run_compare(settings, out, args.overrides, user_variants)
    print((out / "compare.md").read_text())
    more = "".join(f", compare_T{t:g}.*" for t in settings.temperatures)
    print(f"compare.json, compare.md, compare.png{more} in {out} ({summary['wall_seconds'] / 60:.1f} min)")
    return 0


def _eval(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from .data import DataError
    from .embedded.synthetic import check_level_weights
    from .evaluate import default_max_new_tokens, run_eval
    from .wandb_log import WandbMissing, log_eval

    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    problems = [] if benchmarks else ["--benchmarks is empty"]
    problems += [f"--model {m}: {p}" for m in args.model if (p := _not_a_model(m))]
    problems += [
        f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}"
        for name in ("samples", "max_new_tokens", "synthetic_per_level", "limit")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    level_weights = None
    if args.level_weights.strip():
        try:
            level_weights = tuple(float(w) for w in args.level_weights.split(","))
            check_level_weights((1, 2, 3, 4), level_weights)
        except ValueError:
            problems.append(f"--level-weights: 4 comma-separated weights >= 0, not all 0; got {args.level_weights!r}")
    if not args.temperature > 0:
        problems.append(f"--temperature: must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p: must be in (0, 1], got {args.top_p}")
    problems += [p for p in [_not_creatable("--output-dir", args.output_dir)] if p]
    if problems:
        print(f"fasttnt eval: {problems[0]}", file=sys.stderr)
        return 2
    max_new = args.max_new_tokens or default_max_new_tokens(benchmarks)
    settings = replace(
        EvalSettings(),
        samples=args.samples,
        mode=args.mode,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=max_new,
        engine=args.engine,
        seed=args.seed,
        synthetic_per_level=args.synthetic_per_level,
        synthetic_level_weights=level_weights,
        limit=args.limit,
        prompt_style=args.prompt_style,
    )
    hf_logging.disable_progress_bar()
    try:
        report = run_eval(args.model, benchmarks, settings, Path(args.output_dir), save_responses=args.save_responses)
    except DataError as err:
        print(f"fasttnt eval: {err}", file=sys.stderr)
        return 2
    print((Path(args.output_dir) / "eval.md").read_text())
    print(f"eval.json, eval.md, eval.png in {args.output_dir}")
    try:  # a model trained with logging.wandb: the table in its run too
        for run_dir in log_eval(report):
            print(f"the eval table logged to the W&B run of {run_dir}")
    except WandbMissing as err:  # the results are written: say what was not logged, keep the exit status
        print(f"fasttnt eval: not logged to W&B: {err}", file=sys.stderr)
    return 0 if report["results"] else 1


def _not_creatable(flag: str, folder: str) -> str | None:
    """Why ``folder`` cannot be made (or used) as an output folder, in one line; None when it can."""
    from pathlib import Path

    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{flag} {folder}: cannot create it ({err.strerror or err})"
    if not os.access(path, os.W_OK):
        return f"{flag} {folder}: not writable"
    return None


def _not_a_model(name: str) -> str | None:
    """Why ``name`` is certainly no model (a local path that is not a folder); None when it may be one (a folder,
    or a hub id, which only loading can tell)."""
    from pathlib import Path

    from .data import names_a_path

    path = Path(name).expanduser()
    local = names_a_path(name) or path.exists()
    if local and not path.is_dir():
        return "no such folder" if not path.exists() else "not a folder (a model is a Hugging Face folder)"
    if local and not (path / "config.json").is_file():
        return "no config.json in the folder: not a Hugging Face model folder"
    return None


if __name__ == "__main__":
    sys.exit(main())
