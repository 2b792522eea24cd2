"""Self-check: every op's Triton path against its reference in float64, at realistic shapes, on this machine.

    python -m fasttnt_kernels.selfcheck [--quick]

On a CUDA machine the kernels run natively; elsewhere the process re-runs itself under Triton's interpreter
(``TRITON_INTERPRET=1``), which checks correctness but says nothing about speed. Exits 1 if any op is off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _common

# Worst relative error (max |a - b| / max |b|) allowed against float64 at these shapes: float32 arithmetic;
# float32 matmuls whose sums run over 152K products (the fused linear op); a bf16 output (one bf16 ulp); exact.
FP32, MATMUL, BF16, EXACT = 1e-4, 5e-4, 2**-7, 0.0


@dataclass
class CheckResult:
    op: str
    shape: str
    seconds: float
    errors: dict[str, tuple[float, float]]  # output -> (relative error, tolerance)

    @property
    def ok(self) -> bool:
        return all(err <= tol for err, tol in self.errors.values())

    def worst(self) -> tuple[str, float, float]:
        name = max(self.errors, key=lambda k: self.errors[k][0] / max(self.errors[k][1], 1e-30))
        return (name, *self.errors[name])


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("inf")
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return float("inf")
    scale = b[finite].abs().max().clamp(min=1e-12)
    return ((a - b)[finite].abs().max() / scale).item() if finite.any() else 0.0


def _timed(fn: Callable[[], dict[str, torch.Tensor]], device: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    if device.type == "cuda":
        fn()  # compile outside the timing
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _check_token_logprobs(device, quick):
    from .token_logprobs import token_logprobs, token_logprobs_reference

    n, v = (4, 151936) if quick else (16, 151936)
    logits = (torch.randn(n, v, device=device) * 4).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device=device)
    g = torch.randn(n, device=device)

    def run(fn, x):
        x = x.detach().clone().requires_grad_()
        logp, ent = fn(x, ids, temperature=0.6, with_entropy=True)
        (logp * g + ent * g).sum().backward()
        return {"logp": logp, "entropy": ent, "grad": x.grad}

    got, seconds = _timed(lambda: run(token_logprobs, logits), device)
    truth = run(token_logprobs_reference, logits.double())
    # the gradient of a bf16 input is bf16: judged at bf16's resolution
    errors = {k: (_rel_err(got[k], truth[k]), FP32) for k in ("logp", "entropy")}
    errors["grad"] = (_rel_err(got["grad"], truth["grad"]), BF16)
    return CheckResult("token_logprobs", f"{n}x{v} bf16", seconds, errors)


def _check_linear_token_logprobs(device, quick):
    from .linear_token_logprobs import linear_token_logprobs, linear_token_logprobs_reference

    n, h, v = (16, 64, 151936) if quick else (256, 128, 151936)
    hidden = torch.randn(n, h, device=device)
    weight = torch.randn(v, h, device=device) / h**0.5
    ids = torch.randint(0, v, (n,), device=device)
    g = torch.randn(n, device=device)

    def run(fn, hd, w, **kw):
        hd, w = hd.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        logp, ent = fn(hd, w, ids, with_entropy=True, **kw)
        (logp * g + ent * g).sum().backward()
        return {"logp": logp, "entropy": ent, "grad_hidden": hd.grad, "grad_weight": w.grad}

    chunk = n // 4 * v * 4  # four chunks
    got, seconds = _timed(lambda: run(linear_token_logprobs, hidden, weight, chunk_bytes=chunk), device)
    truth = run(linear_token_logprobs_reference, hidden.double(), weight.double())
    errors = {k: (_rel_err(got[k], truth[k]), MATMUL) for k in got}
    return CheckResult("linear_token_logprobs", f"{n}x{h}x{v} fp32", seconds, errors)


def _check_group_advantages(device, quick):
    from .group_advantages import group_advantages, group_advantages_reference

    rewards = torch.randint(-2, 3, (128 * 16,), device=device).float()
    got, seconds = _timed(lambda: {"adv": group_advantages(rewards, 16)}, device)
    errors = {"adv": (_rel_err(got["adv"], group_advantages_reference(rewards.double(), 16)), FP32)}
    return CheckResult("group_advantages", "128x16", seconds, errors)


def _check_mode_advantages(device, quick):
    from .mode_advantages import mode_advantages, mode_advantages_reference

    rewards = torch.randint(-2, 3, (128 * 16,), device=device).float()
    non_thinking = torch.rand(128 * 16, device=device) < 0.5
    got, seconds = _timed(lambda: mode_advantages(rewards, non_thinking, 16)._asdict(), device)
    truth = mode_advantages_reference(rewards.double(), non_thinking, 16)._asdict()
    errors = {k: (_rel_err(got[k], truth[k]), FP32) for k in got}
    return CheckResult("mode_advantages", "128x16", seconds, errors)


def _check_clipped_policy_loss(device, quick):
    from ._policy_loss import PolicyLossConfig
    from .clipped_policy_loss import clipped_policy_loss, clipped_policy_loss_reference

    s = 128 if quick else 2048
    lengths = torch.randint(1, 400, (s,), device=device)
    cu = torch.zeros(s + 1, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    logp = -torch.rand(n, device=device) * 4
    old = logp + torch.randn(n, device=device) * 0.3
    ref = logp + torch.randn(n, device=device) * 0.3
    adv = torch.randn(s, device=device)
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.01)

    def run_triton():
        x = logp.clone().requires_grad_()
        loss, stats = clipped_policy_loss(x, old, adv, cu, ref_logp=ref, config=config)
        loss.backward()
        return {"loss": loss, "grad": x.grad, **stats}

    got, seconds = _timed(run_triton, device)
    x = logp.double().requires_grad_()
    loss, stats = clipped_policy_loss_reference(x, old.double(), adv.double(), cu, config=config, ref_logp=ref.double())
    loss.backward()
    truth = {"loss": loss, "grad": x.grad, **stats}
    errors = {k: (_rel_err(got[k], truth[k]), FP32) for k in ("loss", "grad", "clip_frac_low", "clip_frac_high")}
    return CheckResult("clipped_policy_loss", f"{s} seqs, {n} tokens", seconds, errors)


def _check_tnt_rewards(device, quick):
    from .tnt_rewards import tnt_rewards, tnt_rewards_reference

    g, k, end = 128, 16, 5
    lengths = torch.randint(0, 600, (g * k,), device=device)
    cu = torch.zeros(g * k + 1, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    ids = torch.randint(0, 50, (int(cu[-1]),), device=device)
    correct = torch.rand(g * k, device=device) < 0.5
    got, seconds = _timed(lambda: tnt_rewards(ids, cu, correct, k, end)._asdict(), device)
    truth = tnt_rewards_reference(ids, cu, correct, k, end)._asdict()
    errors = {name: (0.0 if torch.equal(got[name], truth[name]) else float("inf"), EXACT) for name in got}
    return CheckResult("tnt_rewards", f"{g}x{k}, {int(cu[-1])} tokens", seconds, errors)


CHECKS = (
    _check_token_logprobs,
    _check_linear_token_logprobs,
    _check_group_advantages,
    _check_mode_advantages,
    _check_clipped_policy_loss,
    _check_tnt_rewards,
)


def run_checks(*, quick: bool = False, seed: int = 0) -> list[CheckResult]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    old = os.environ.get(_common.BACKEND_ENV)
    os.environ[_common.BACKEND_ENV] = "triton"
    try:
        for check in CHECKS:
            torch.manual_seed(seed)
            result = check(device, quick)
            results.append(result)
            name, err, tol = result.worst()
            verdict = "ok" if result.ok else "FAILED"
            print(
                f"  {result.op:<22} {result.shape:<26} {result.seconds * 1e3:9.1f} ms"
                f"   worst: {name} rel err {err:.1e} (tol {tol:.1e})  {verdict}",
                flush=True,
            )
    finally:
        if old is None:
            os.environ.pop(_common.BACKEND_ENV, None)
        else:
            os.environ[_common.BACKEND_ENV] = old
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fasttnt_kernels.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (seconds under the interpreter)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        try:
            import numpy  # noqa: F401
        except ImportError:
            print("no CUDA device, and Triton's CPU interpreter needs numpy: pip install numpy")
            return 2
    if not torch.cuda.is_available() and not _common.interpreter_active():
        # Triton decides between compiling and interpreting when the kernels are defined: start over with it on
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "fasttnt_kernels.selfcheck", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(cmd, env=env, check=False).returncode

    if torch.cuda.is_available():
        where = f"CUDA ({torch.cuda.get_device_name()}), Triton compiled"
    else:
        where = "CPU, Triton interpreter (times measure the interpreter, not the kernels)"
    print(f"fasttnt_kernels self-check on {where}; float64 reference as truth", flush=True)
    results = run_checks(quick=args.quick, seed=args.seed)
    failed = [r.op for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
