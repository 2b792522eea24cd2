"""The training loop on a GPU: ``--steps`` steps of ``fasttnt train`` (hf engine, bf16 autocast) on the embedded
default and on a stand-in of the real vocabulary (Qwen2-0.5B's width, 2 layers, 151,936 tokens, random weights, the
character tokenizer padded to that size), then DeepSpeed's engine on one GPU with and without its torch_autocast
section. Per run: every step's loss checked finite, generated and trained tokens/s, the peak memory, and the
trainer-vs-engine log-prob difference per token that the stale-weight guard reads (``rollout_logp_diff``: under
bf16 the hf engine's sampling forward against the trainer's packed forward).

    python benchmarks/gpu_loop.py [--steps 10] [--out DIR] [--work DIR] [--skip-deepspeed]
    python benchmarks/gpu_loop.py --smoke          # the script itself on the CPU: 1 step, small shapes, no DeepSpeed

Writes gpu_loop.json to ``--out`` after each part; the runs themselves go to a temporary folder (``--work``), removed
at the end. Prints ``SKIPPED:`` and the reason for a part it cannot run (DeepSpeed not installed), and exits 1 when a
step's loss is not finite, the update trained nothing, or bf16 does not reach the forward inside DeepSpeed's engine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REAL_VOCAB = 151_936  # Qwen2 / DeepSeek-R1-Distill-Qwen
# Qwen2.5-0.5B's width (hidden 896, 14 query / 2 KV heads, MLP 4864, tied), cut to 2 layers
REAL_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip


# the embedded default's warm-up made short: it runs on the CPU (embedded/tiny.py), and 800 steps would spend the
# check's minutes there. The loop is checked, not learning: a few seconds of warm-up, and the update runs on every
# sequence, zero advantages included (loss.skip_zero_advantage=false), so a short warm-up's or a random model's
# equal rewards still reach the loss, and the trained tokens/s are the whole batch's
CHECK_OVERRIDES = ["warmup.steps=60", "warmup.batch_size=32", "loss.skip_zero_advantage=false"]

# --smoke: the tiny model at a small width and a short run, so the script's own code runs on a CPU in seconds
SMOKE = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1",
         "warmup.steps=3", "warmup.batch_size=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=8", "verify_workers=1"]  # fmt: skip


def real_vocab_standin(folder: Path, *, vocab: int = REAL_VOCAB, shape: dict = REAL_SHAPE) -> str:
    """A random-weight Qwen2 of ``shape`` with a ``vocab``-token character tokenizer, saved as a model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fasttnt.embedded.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(vocab_size=vocab)
    config = Qwen2Config(vocab_size=vocab, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **shape)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def train(name: str, out: Path, overrides: list[str], device: str) -> dict:
    """One run of the loop; its per-step numbers and the peak memory."""
    from fasttnt.config import load_config
    from fasttnt.trainer import Trainer

    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(load_config(None, [f"device={device}", *overrides]), out / name, progress=False)
    rows = trainer.run()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    finite = all(math.isfinite(r["loss"]) for r in rows)
    print(f"{name}: {len(rows)} steps, loss finite at every step: {finite}; peak memory {peak:.2f} GiB")
    print(f"  {'step':>4} {'loss':>10} {'gen tok/s':>11} {'train tok/s':>12} {'logp diff':>10}")
    for r in rows:
        print(f"  {r['step']:>4} {r['loss']:>10.4f} {r['generated_tokens_per_s']:>11.0f} "
              f"{r['trained_tokens_per_s']:>12.0f} {r.get('rollout_logp_diff', float('nan')):>10.2e}")  # fmt: skip
    steady = rows[1:] or rows  # the first step compiles and allocates
    # a step whose every sequence is skipped (zero advantages, where skipped) trains nothing: its speed is no update's
    skipped = [r.get("skipped_seq_frac", 0.0) for r in rows]
    update_ran = min(skipped) < 1.0
    if not update_ran:
        print(f"{name}: the update skipped every sequence at every step (zero advantages): nothing was trained")
    return {
        "run": name, "steps": len(rows), "loss_finite": finite, "update_ran": update_ran,
        "skipped_seq_frac": skipped, "peak_gib": peak,
        "generated_tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in steady),
        "trained_tokens_per_s": statistics.median(r["trained_tokens_per_s"] for r in steady),
        "rollout_logp_diff_max": max(r.get("rollout_logp_diff", float("nan")) for r in rows),
    }  # fmt: skip


def deepspeed_autocast() -> dict:
    """The dtype of the linear layers' outputs inside DeepSpeed's engine.forward under an outer bf16 autocast, with
    fasttnt's DeepSpeed config without and with its torch_autocast section (one GPU, world of 1)."""
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fasttnt import distributed
    from fasttnt.attention import Packing
    from fasttnt.config import TrainConfig
    from fasttnt.engines.vllm import _external_launcher_env
    from fasttnt.policy import PolicyHead

    _external_launcher_env()  # a world of one, on a free port, as the vllm engine sets it up for one process
    deepspeed.init_distributed(dist_backend="nccl")
    seen: dict[str, list[str]] = {}
    for autocast in (False, True):
        shape = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        model = Qwen2ForCausalLM(shape).cuda()
        config = distributed.deepspeed_config(TrainConfig(), 1, autocast=autocast)
        engine, _, _, _ = deepspeed.initialize(model=PolicyHead(model), optimizer=torch.optim.AdamW(model.parameters()),
                                               config=config)  # fmt: skip
        dtypes = seen.setdefault(f"torch_autocast section {'on' if autocast else 'off'}", [])
        hooks = [m.register_forward_hook(lambda _m, _a, out, into=dtypes: into.append(str(out.dtype)))
                 for m in model.modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
        ids = torch.randint(4, 64, (1, 10), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            engine(ids, torch.arange(5, device="cuda").repeat(2)[None], Packing.of([5, 5], "cuda"),
                   torch.tensor([3, 8], device="cuda"), ids[0, [4, 9]], 1.0, False)  # fmt: skip
        for h in hooks:
            h.remove()
        print(f"DeepSpeed {deepspeed.__version__}, {list(seen)[-1]}: the forward inside the engine ran in "
              f"{sorted(set(dtypes))}")  # fmt: skip
    return {k: sorted(set(v)) for k, v in seen.items()}


def _write(out: Path | None, results: dict) -> None:
    """gpu_loop.json as it stands (with ``--out``): rewritten after each part, so a run stopped at its time limit
    keeps the parts it finished."""
    if out is not None:
        (out / "gpu_loop.json").write_text(json.dumps(results, indent=1))


def _import_error(module: str) -> str | None:
    """Why ``module`` does not import (not installed, or a dependency of it missing), or None when it does."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, help="where gpu_loop.json goes (default: none, the results printed)")
    parser.add_argument("--work", type=Path, help="the runs' folders and the stand-in model (default: a temporary "
                        "folder, removed at the end: a checkpoint of the stand-in alone is ~2 GB)")  # fmt: skip
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the script on the CPU: 1 step, small shapes")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_loop.py needs CUDA (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    device, steps_n = ("cpu", 1) if args.smoke else ("cuda", args.steps)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fasttnt-gpu-loop-")))
        return run_parts(work, args.out, device, steps_n, args)


def run_parts(work: Path, out: Path | None, device: str, steps_n: int, args) -> int:
    # two mini-batches: the old log-probs are computed every step, and with them the engine's difference. The
    # warm-up cache lives in the working folder: a short warm-up (``CHECK_OVERRIDES``) each time
    steps = [f"steps={steps_n}", f"save_every={steps_n}", f"cache_dir={work / 'cache'}", "loss.mini_batches=2",
             *CHECK_OVERRIDES, *(SMOKE if args.smoke else [])]  # fmt: skip
    results: dict = {"runs": []}
    results["runs"].append(train("embedded default", work, steps, device))
    _write(out, results)
    small = dict(vocab=1000, shape={**REAL_SHAPE, "hidden_size": 28, "intermediate_size": 56}) if args.smoke else {}
    folder = real_vocab_standin(work / "real-vocab-model", **small)
    results["runs"].append(train("real vocabulary", work, [*steps, f"model.name={folder}"], device))
    _write(out, results)
    ok = all(r["loss_finite"] and r["update_ran"] for r in results["runs"])
    if args.skip_deepspeed or args.smoke:
        print(f"SKIPPED: DeepSpeed's autocast section ({'--smoke' if args.smoke else '--skip-deepspeed'})")
    elif (missing := _import_error("deepspeed")) is not None:
        print(f"SKIPPED: DeepSpeed's autocast section: deepspeed does not import ({missing}; a bare GPU image lacks "
              "it and pydantic: carry their wheels in .whl/)")  # fmt: skip
    else:
        try:
            results["deepspeed"] = seen = deepspeed_autocast()
        except (RuntimeError, ValueError, AssertionError, TypeError) as err:  # reported; the runs' numbers kept
            print(f"the DeepSpeed check failed: {type(err).__name__}: {err}")
            results["deepspeed"] = {"error": f"{type(err).__name__}: {err}"}
            seen = {}
        ok = ok and seen.get("torch_autocast section on") == ["torch.bfloat16"]
        _write(out, results)
    print(f"{f'results in {out}/gpu_loop.json; ' if out else ''}{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
