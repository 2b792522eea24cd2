"""Kernel speed, memory and correctness against TRL 1.16's kernels, eager PyTorch, torch.compile and Liger-Kernel.

    python benchmarks/bench_kernels.py                      # CUDA: every op at the shapes that matter
    python benchmarks/bench_kernels.py --max-seconds 140    # starts nothing new after 140 s; the rest is listed
    python benchmarks/bench_kernels.py --memory-only        # any Linux machine: peak memory of the fused lm_head path
    python benchmarks/bench_kernels.py --smoke              # tiny shapes, every code path (CPU: interpreter)
    python benchmarks/bench_kernels.py --losses-only --tokens 4096 --hidden 1536   # the policy losses, any device

What each op is compared with, one CSV row per provider (``--providers`` picks the baselines):

    token_logprobs          (N, V) logits -> log-prob of the chosen token
      fasttnt                         fasttnt_kernels.token_logprobs
      trl                             trl.trainer.utils.selective_log_softmax: on CUDA it dispatches to its Triton
                                      kernel (trl/kernels/logprob_entropy.py); elsewhere it loops over rows in eager
      torch                           eager, one sequence at a time: log_softmax -> gather (TRL before its kernels)
      torch.compile                   that formula compiled
    linear_token_logprobs   (N, H) hidden states and the (V, H) lm_head -> log-probs
      fasttnt                         fasttnt_kernels.linear_token_logprobs
      trl                             trl.kernels.ChunkedLogProbFunction: token x vocab tiles, float32 gradients
      torch (materialised)            eager, one sequence at a time: logits -> log_softmax -> gather
      torch.compile (materialised)    that formula compiled
      liger                           Liger-Kernel's fused linear cross-entropy, reduction="none", negated
    linear_policy_loss      the lm_head through the clipped GRPO loss (token-mean), to the lm_head's gradients
      fasttnt                         fasttnt_kernels.linear_policy_loss: gradients made in the forward's chunk loop
      fasttnt (unfused)               linear_token_logprobs -> clipped_policy_loss
      trl                             ChunkedLogProbFunction -> TRL's token-level GRPO loss in torch
      torch (materialised)            eager per sequence -> the same torch loss
      liger (fused linear CE)         the nearest fused-lm_head peer: its loss is cross-entropy, not the policy loss
    linear_policy_loss loss=L   the same for the other policy losses, each under TRL's loss_type of it (gspo: grpo
                                with importance_sampling_level="sequence"; cispo; sapo; vespo)
      fasttnt                         fasttnt_kernels.linear_policy_loss, policy_loss=L (TRL's settings as the drop-in
                                      fasttnt.integrations.trl maps them)
      trl                             ChunkedLogProbFunction -> TRL 1.16's loss of that loss_type in torch
      liger                           Liger-Kernel's LigerFusedLinearGRPOLoss (liger_kernel.chunked_loss, eager) of that
                                      loss_type: its own chunked lm_head, on sequences padded to (B, T) in the call
    clipped_policy_loss, group_advantages, mode_advantages, tnt_rewards: fasttnt against its plain-PyTorch reference
      (and compiled)

Before a provider is timed, its output and input gradients on that case are checked against a float64 truth (a
random upstream gradient for per-token outputs); a row that misses the dtype's tolerance, or holds a NaN, is
``FAIL``. Times are medians (and 20th/80th percentiles) of ``triton.testing.do_bench`` on CUDA, with achieved GB/s
against the measured copy bandwidth and, for the lm_head ops, TFLOP/s against the measured bf16 matmul rate. For
the ops that make their gradients in the forward (fasttnt's and Liger's fused losses) only fwd+bwd compares.
On the CPU only memory is reported: it is algorithmic and holds on any device; CPU times are not kernel speed.

A case's tensors are made when it runs and freed after it. A case or provider whose estimated memory exceeds what
is free (``torch.cuda.mem_get_info``; ``--memory-limit-gib`` caps it) is skipped with the reason. Every row (measured,
failed, skipped, or not run before the ``--max-seconds`` deadline) is appended to the CSV and flushed as it is made,
so a run that is killed keeps what it measured; the CSV also records the device, date, versions and command.
Each reason for skipped rows, and the rows not run, get a line starting ``SKIPPED:``. The exit status is 1 when a row
is ``FAIL``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import proc_memory
import torch

HERE = Path(__file__).resolve().parent
# Ceilings measured on an H200 (../shared/DESIGN.md): device copy and dense bf16 matmul.
H200_COPY_GBPS = 4300.0
H200_BF16_TFLOPS = 790.0
# TRL's GRPO trainer calls ChunkedLogProbFunction with vocabulary tiles of this width (_CHUNKED_LOGPROB_CHUNK_SIZE
# in trl/trainer/utils.py, TRL 1.16)
TRL_VOCAB_CHUNK = 32768
# Largest error against the float64 truth, as ||actual - truth|| / ||truth||, by the dtype of the case's inputs.
TOLERANCE = {
    # float32 accumulation over a 152K vocabulary errs by ~1e-4 relative at worst (tests/kernels/checks.py)
    torch.float32: 1e-4,
    # bf16 logits and gradients carry 2^-8 each, and log-probs kept in bf16 (TRL's eager path) err by up to 0.03
    # at |logp| ~ 12, which the policy loss's exp(logp - old) turns into a gradient error of 0.025 (measured at
    # V = 151936; 0.003 for float32 log-probs): 2^-4 passes those, while a wrong formula errs by O(1)
    torch.bfloat16: 2**-4,
}
# Fraction of the free memory a case may plan to use: the rest is headroom for the allocator's fragmentation.
MEMORY_HEADROOM = 0.9
# Bytes of one float64 chunk of logits in the truth computations, so the truth fits beside the largest case.
TRUTH_CHUNK_BYTES = 256 * 2**20
GIB = 2**30


# -- the formulations we compare against ----------------------------------------------------------------------


def eager_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """What TRL ran before its kernels (selective_log_softmax's eager loop over the rows of (B, T, V) logits): per
    sequence, log_softmax over the vocabulary in the logits' own dtype, then gather. One sequence at a time keeps
    one sequence's log-softmax alive in the forward, not the batch's."""
    return torch.cat([torch.log_softmax(logits[s:e], dim=-1).gather(-1, ids[s:e, None])[:, 0] for s, e in bounds])


def flat_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The same formula over the whole batch: what torch.compile is given. The loop over sequences exists only to
    bound eager memory; compiled, log_softmax and gather fuse into reductions, and unrolling S sequences would
    compile S copies of the graph."""
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None])[:, 0]


def eager_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, bounds: list[tuple[int, int]]
) -> torch.Tensor:
    """Per sequence: the sequence's logits, then eager_token_logprobs's formula (a trainer without a fused
    lm_head)."""
    return torch.cat(
        [torch.log_softmax(hidden[s:e] @ weight.T, dim=-1).gather(-1, ids[s:e, None])[:, 0] for s, e in bounds]
    )


def materialised_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """All N x V logits at once, then log_softmax and gather (torch.compile's input, and the memory rows')."""
    return flat_token_logprobs(hidden @ weight.T, ids)


def torch_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv_t: torch.Tensor, n_tokens: int, clip: float = 0.2
) -> torch.Tensor:
    """TRL's GRPO loss per token in torch (GRPOTrainer._compute_loss, trl/trainer/grpo_trainer.py: token-level
    importance ratio, two-sided clip, loss_type="dapo", i.e. the sum over tokens / the number of tokens, no KL)."""
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - clip, 1 + clip)
    per_token_loss = -torch.min(coef_1 * adv_t, coef_2 * adv_t)
    return per_token_loss.sum() / n_tokens


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _version(dist: str) -> str:
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return dist


def _trl_selective_log_softmax(device):
    from trl.trainer.utils import selective_log_softmax

    how = "Triton kernel" if device.type == "cuda" else "eager loop over rows (no CUDA)"
    return (lambda x: selective_log_softmax(x["logits"], x["ids"])), f"{_version('trl')}: {how}"


def _trl_chunked_logprobs():
    """TRL's fused lm_head log-probs as its trainer calls them: (hidden, weight, bias, targets, temperature,
    vocab chunk, softcapping, logit scale, extra outputs); only the log-probs are asked for. trl.kernels imports
    neither datasets nor the trainer."""
    from trl.kernels import ChunkedLogProbFunction

    def logprobs(hidden, weight, ids):
        return ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())[0]

    return logprobs, f"{_version('trl')}: vocab chunk {TRL_VOCAB_CHUNK}"


def _liger_flce(device):
    """Liger's fused linear cross-entropy: bf16 gradient matmuls (accum_dtype None). Its chunked PPO/GRPO loss
    (liger_kernel.chunked_loss) is the family rows' baseline (``loss_family_case``), not these: it upcasts every
    chunk's gradient matmuls to float32 (grad_logits @ weight_chunk.float() in fused_linear_ppo.py), a different
    precision and cost from fasttnt's vanilla row's. A Triton kernel: on the CPU only under the interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError("Liger's fused linear cross-entropy is a Triton kernel: CUDA (or TRITON_INTERPRET=1)")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy, _version("liger-kernel")


# -- cases: what one op at one shape needs, made only when it runs ---------------------------------------------


@dataclass
class Provider:
    name: str
    # () -> (call(inputs) -> output, note): imports what it needs, so a missing library is a skipped row
    setup: Callable[[], tuple[Callable[[dict], torch.Tensor], str]]
    truth: str = "main"  # which float64 truth its output and gradients are checked against
    extra_bytes: float = 0.0  # working memory beyond the case's inputs (an estimate, for the skip decision)


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype  # the inputs' dtype, which sets the tolerance
    make: Callable[[], dict]  # allocates the inputs (tensors named by key) when the case runs
    # (inputs, output, truth name, cache) -> (output error, gradient error): against float64, cached per case
    check: Callable[[dict, torch.Tensor, str, dict], tuple[float, float]]
    providers: list[Provider]
    grads: tuple[str, ...] = ()  # the inputs that get gradients
    input_bytes: float = 0.0  # the inputs and their gradients
    truth_bytes: float = 0.0  # the float64 truth and what it caches
    bytes_fwd: float = 0.0  # DRAM bytes the forward must move at least
    flops_fwd: float = 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _packed_layout(n: int, mean_len: int, seed: int) -> list[tuple[int, int]]:
    """Sequence boundaries filling n tokens: lengths uniform in [1, 2 mean_len), the last one cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    bounds, start = [], 0
    while start < n:
        end = min(n, start + int(torch.randint(1, 2 * mean_len, (1,), generator=gen)))
        bounds.append((start, end))
        start = end
    return bounds


def _cu_seqlens(bounds: list[tuple[int, int]], device) -> torch.Tensor:
    return torch.tensor([0] + [e for _, e in bounds], dtype=torch.int64, device=device)  # (S+1,)


def _truth_rows(vocab: int) -> int:
    return max(1, TRUTH_CHUNK_BYTES // (8 * vocab))


def _truth_chunk_bytes(n: int, vocab: int) -> float:
    return 8.0 * min(n, _truth_rows(vocab)) * vocab


def rel_err(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], floor: float = 0.0) -> float:
    """||actual - truth|| / max(||truth||, floor) over (actual, truth) pieces, in float64. A NaN or an infinity in
    ``actual`` is an infinite error: it never passes. ``floor`` is the output's natural scale where the truth can be
    near zero (a loss whose terms cancel)."""
    diff2 = truth2 = 0.0
    for actual, truth in pairs:
        a = actual.double()
        if not bool(torch.isfinite(a).all()):
            return math.inf
        diff2 += float(((a - truth) ** 2).sum())
        truth2 += float((truth.double() ** 2).sum())
    return math.sqrt(diff2) / max(math.sqrt(truth2), floor, 1e-30)


def _pieces(actual: torch.Tensor, truth: torch.Tensor, step: int = 1 << 25) -> Iterator[tuple[torch.Tensor, ...]]:
    """Flat slices of two tensors, so comparing two large gradients never makes full float64 copies."""
    a, t = actual.reshape(-1), truth.reshape(-1)
    for s in range(0, a.numel(), step):
        yield a[s : s + step], t[s : s + step]


def _logits_logp64(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    rows = _truth_rows(logits.shape[1])
    out = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)  # (N,)
    for s in range(0, logits.shape[0], rows):
        z = logits[s : s + rows].double()  # (C, V)
        out[s : s + rows] = torch.log_softmax(z, -1).gather(-1, ids[s : s + rows, None])[:, 0]
    return out


def _dlogits64(z: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(sum_t g_t logp_t)/dz for a chunk of float64 logits: g_t (onehot(ids_t) - softmax(z_t))."""
    dz = torch.softmax(z, dim=-1).mul_(-g[:, None])
    dz[torch.arange(z.shape[0], device=z.device), ids] += g
    return dz


def _lm_head_logp64(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = weight.double()
    rows = _truth_rows(weight.shape[0])
    out = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)  # (N,)
    for s in range(0, hidden.shape[0], rows):
        z = hidden[s : s + rows].double() @ w.T  # (C, V)
        out[s : s + rows] = torch.log_softmax(z, -1).gather(-1, ids[s : s + rows, None])[:, 0]
    return out


def _lm_head_grads64(hidden, weight, ids, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum_t g_t logp_t w.r.t. hidden and weight, in float64 row chunks, kept in float32 (far finer
    than any tolerance) so that the truth of a 7B lm_head fits beside the case."""
    w = weight.double()
    grad_w = torch.zeros_like(w)  # (V, H)
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)  # (N, H)
    rows = _truth_rows(weight.shape[0])
    for s in range(0, hidden.shape[0], rows):
        h = hidden[s : s + rows].double()
        dz = _dlogits64(h @ w.T, ids[s : s + rows], g[s : s + rows])
        grad_h[s : s + rows] = dz @ w
        grad_w += dz.T @ h
    return grad_h, grad_w.float()


def _lm_head_truth_bytes(n: int, h: int, v: int, n_truths: int) -> float:
    # the float64 weight and its gradient, three chunk-sized temporaries, and per truth the cached float32 grads
    return 16.0 * v * h + 3 * _truth_chunk_bytes(n, v) + n_truths * 4.0 * (n * h + v * h) + 16.0 * n


def token_logprob_case(n: int, v: int, dtype, device, mean_len: int) -> Case:
    e = torch.empty((), dtype=dtype).element_size()
    bounds = _packed_layout(n, mean_len, seed=n)

    def make():
        logits = torch.randn(n, v, device=device, dtype=dtype, requires_grad=True)
        ids = torch.randint(0, v, (n,), device=device)
        return {"logits": logits, "ids": ids, "upstream": torch.randn(n, device=device)}

    def check(x, out, truth, cache):
        if "logp" not in cache:
            cache["logp"] = _logits_logp64(x["logits"].detach(), x["ids"])
        rows = _truth_rows(v)
        logits, ids, u = x["logits"].detach(), x["ids"], x["upstream"].double()

        def grad_pieces():
            for s in range(0, n, rows):
                yield (
                    x["logits"].grad[s : s + rows],
                    _dlogits64(logits[s : s + rows].double(), ids[s : s + rows], u[s : s + rows]),
                )

        return rel_err([(out, cache["logp"])]), rel_err(grad_pieces())

    def fasttnt():
        from fasttnt_kernels import token_logprobs

        return (lambda x: token_logprobs(x["logits"], x["ids"])), ""

    def compiled():
        fn = torch.compile(flat_token_logprobs, dynamic=False)
        return (lambda x: fn(x["logits"], x["ids"])), ""

    nv = n * v
    providers = [
        Provider("fasttnt", fasttnt),
        Provider("trl", lambda: _trl_selective_log_softmax(device), extra_bytes=nv * e),
        # every sequence's log-softmax is saved for the backward (N x V in all), and one float32 row block while
        # its gradient is made: N x V float32 bounds both
        Provider(
            "torch",
            lambda: ((lambda x: eager_token_logprobs(x["logits"], x["ids"], bounds)), ""),
            extra_bytes=nv * 4.0,
        ),
        Provider("torch.compile", compiled, extra_bytes=nv * 4.0),
    ]
    return Case(
        "token_logprobs",
        f"N={n} V={v} S={len(bounds)} {_dtype_name(dtype)}",
        dtype,
        make,
        check,
        providers,
        grads=("logits",),
        input_bytes=2.0 * nv * e,
        truth_bytes=3 * _truth_chunk_bytes(n, v) + 8.0 * n,
        bytes_fwd=nv * e,
    )


def _lm_head_inputs(n: int, h: int, v: int, dtype, device) -> dict:
    hidden = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    # scaled so the logits have unit variance, as a trained lm_head's roughly do
    weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_()
    ids = torch.randint(0, v, (n,), device=device)
    return {"hidden": hidden, "weight": weight, "ids": ids}


def _lm_head_check(value_and_grad: dict[str, Callable[[dict, torch.Tensor], tuple]], floor: dict[str, Callable]):
    """A check for the lm_head ops: ``value_and_grad[truth](inputs, logp64) -> (value, d value / d logp)`` turns
    the float64 log-probs into the provider's output; the lm_head's gradients follow in float64 chunks."""

    def check(x, out, truth, cache):
        hidden, weight, ids = x["hidden"].detach(), x["weight"].detach(), x["ids"]
        if "logp" not in cache:  # made with the inputs when they depend on it (the rollout's log-probs)
            cache["logp"] = x["logp64"] if "logp64" in x else _lm_head_logp64(hidden, weight, ids)
        if truth not in cache:
            value, g = value_and_grad[truth](x, cache["logp"])
            cache[truth] = (value, *_lm_head_grads64(hidden, weight, ids, g))
        value, grad_h, grad_w = cache[truth]
        out_err = rel_err([(out, value)], floor=floor[truth](x))
        grad_err = max(rel_err(_pieces(x["hidden"].grad, grad_h)), rel_err(_pieces(x["weight"].grad, grad_w)))
        return out_err, grad_err

    return check


def linear_case(n: int, h: int, v: int, dtype, device, mean_len: int) -> Case:
    e = torch.empty((), dtype=dtype).element_size()
    bounds = _packed_layout(n, mean_len, seed=n)

    def make():
        return {**_lm_head_inputs(n, h, v, dtype, device), "upstream": torch.randn(n, device=device)}

    def per_token(x, logp64):
        return logp64, x["upstream"].double()

    def fasttnt():
        from fasttnt_kernels import linear_token_logprobs

        return (lambda x: linear_token_logprobs(x["hidden"], x["weight"], x["ids"])), ""

    def trl():
        logprobs, note = _trl_chunked_logprobs()
        return (lambda x: logprobs(x["hidden"], x["weight"], x["ids"])), note

    def compiled():
        fn = torch.compile(materialised_linear_logprobs, dynamic=False)
        return (lambda x: fn(x["hidden"], x["weight"], x["ids"])), ""

    def liger():
        flce, note = _liger_flce(device)
        # reduction="none" defers the gradient to the backward, which recomputes the logits: 4 matmuls, as ours
        return (lambda x: -flce(x["hidden"], x["weight"], x["ids"], reduction="none")), note

    nv, hv = n * v, (n + v) * h
    providers = [
        Provider("fasttnt", fasttnt, extra_bytes=2 * 512 * 2**20),
        Provider("trl", trl, extra_bytes=hv * 4.0 + 2 * 4096 * TRL_VOCAB_CHUNK * e),
        Provider(
            "torch (materialised)",
            lambda: ((lambda x: eager_linear_logprobs(x["hidden"], x["weight"], x["ids"], bounds)), ""),
            extra_bytes=nv * 4.0 + 2 * mean_len * 2 * v * 4.0,
        ),
        Provider("liger", liger, extra_bytes=hv * e + 2 * n * h * e),
        # last: its first call compiles for ~10-30 s, the first to go when a deadline comes
        Provider("torch.compile (materialised)", compiled, extra_bytes=nv * (e + 4.0)),
    ]
    return Case(
        "linear_token_logprobs",
        f"N={n} H={h} V={v} S={len(bounds)} {_dtype_name(dtype)}",
        dtype,
        make,
        _lm_head_check({"main": per_token}, {"main": lambda x: 0.0}),
        providers,
        grads=("hidden", "weight"),
        input_bytes=2.0 * hv * e,
        truth_bytes=_lm_head_truth_bytes(n, h, v, 1),
        bytes_fwd=hv * e,
        flops_fwd=2.0 * n * h * v,
    )


def linear_loss_case(n: int, h: int, v: int, dtype, device, mean_len: int) -> Case:
    from fasttnt_kernels import clipped_policy_loss_reference

    e = torch.empty((), dtype=dtype).element_size()
    bounds = _packed_layout(n, mean_len, seed=n)

    def make():
        x = _lm_head_inputs(n, h, v, dtype, device)
        cu = _cu_seqlens(bounds, device)
        adv = torch.randn(len(bounds), device=device)  # (S,)
        # the rollout's log-probs: the truth's minus log-ratios spread over [-0.6, 0.6], so the clip acts on both
        # sides, but none within 0.05 of a clip boundary (log 0.8, log 1.2): a 16-bit logp errs by ~0.01, and a
        # token that crossed a boundary would turn its gradient from ratio * A / N to 0 in one provider, not the truth
        logp64 = _lm_head_logp64(x["hidden"].detach(), x["weight"].detach(), x["ids"])
        log_ratio = _log_ratios_off(n, 0.6, (math.log(0.8), math.log(1.2)), device)  # (N,)
        old = (logp64 - log_ratio).float()  # (N,)
        adv_t = adv.repeat_interleave(cu.diff(), output_size=n)  # (N,) TRL's advantages, one per token
        return {**x, "cu": cu, "adv": adv, "adv_t": adv_t, "old": old, "logp64": logp64}

    def policy_loss(x, logp64):
        logp = logp64.clone().requires_grad_()
        loss, _ = clipped_policy_loss_reference(logp, x["old"].double(), x["adv"].double(), x["cu"])
        loss.backward()
        return loss.detach(), logp.grad

    def mean_ce(x, logp64):
        return -logp64.mean(), torch.full_like(logp64, -1.0 / n)

    def fused():
        from fasttnt_kernels import PolicyLossInputs, linear_policy_loss

        def call(x):
            inputs = PolicyLossInputs(x["adv"], x["cu"], old_logp=x["old"])
            return linear_policy_loss(x["hidden"], x["weight"], x["ids"], inputs)[0]

        return call, ""

    def unfused():
        from fasttnt_kernels import clipped_policy_loss, linear_token_logprobs

        def call(x):
            logp = linear_token_logprobs(x["hidden"], x["weight"], x["ids"])
            return clipped_policy_loss(logp, x["old"], x["adv"], x["cu"])[0]

        return call, ""

    def trl():
        logprobs, note = _trl_chunked_logprobs()

        def call(x):
            return torch_policy_loss(logprobs(x["hidden"], x["weight"], x["ids"]), x["old"], x["adv_t"], n)

        return call, note

    def eager():
        def call(x):
            logp = eager_linear_logprobs(x["hidden"], x["weight"], x["ids"], bounds)
            return torch_policy_loss(logp, x["old"], x["adv_t"], n)

        return call, ""

    def liger():
        flce, note = _liger_flce(device)
        # reduction="mean" makes the gradients inside the forward's chunk loop, as linear_policy_loss does
        return (lambda x: flce(x["hidden"], x["weight"], x["ids"], reduction="mean")), note + ": mean cross-entropy"

    nv, hv = n * v, (n + v) * h
    providers = [
        Provider("fasttnt", fused, extra_bytes=hv * 4.0 + 2 * 512 * 2**20),
        Provider("fasttnt (unfused)", unfused, extra_bytes=2 * 512 * 2**20),
        Provider("trl", trl, extra_bytes=hv * 4.0 + 2 * 4096 * TRL_VOCAB_CHUNK * e),
        Provider("torch (materialised)", eager, extra_bytes=nv * 4.0 + 2 * mean_len * 2 * v * 4.0),
        Provider("liger (fused linear CE)", liger, truth="ce", extra_bytes=hv * e + 2 * n * h * e),
    ]
    return Case(
        "linear_policy_loss",
        f"N={n} H={h} V={v} S={len(bounds)} {_dtype_name(dtype)}",
        dtype,
        make,
        # a token-mean of +-ratio * A can cancel to ~0: measure its error against the scale of mean |A|
        _lm_head_check(
            {"main": policy_loss, "ce": mean_ce},
            {"main": lambda x: float(x["adv_t"].abs().mean()), "ce": lambda x: 0.0},
        ),
        providers,
        **_lm_head_loss_costs(n, h, v, e),
    )


def _log_ratios_off(n: int, spread: float, kinks: tuple[float, ...], device) -> torch.Tensor:
    """Rollout log-ratios (N,) float64, uniform over [-spread, spread], none within 0.05 of a loss's kink (a log of a
    clip bound or cap; such a token is moved 0.1 away): a 16-bit logp errs by ~0.01, and a token across a kink would
    take another branch in one provider than in the truth."""
    log_ratio = torch.rand(n, device=device, dtype=torch.float64) * (2 * spread) - spread
    for kink in kinks:
        near = (log_ratio - kink).abs() < 0.05
        log_ratio = torch.where(near, log_ratio + 0.1 * torch.sign(log_ratio - kink), log_ratio)
    return log_ratio


def _lm_head_loss_costs(n: int, h: int, v: int, e: int) -> dict:
    """A fused lm_head loss case's gradients and sizes: hidden states and weight in and their gradients, the float64
    truth, the bytes and flops of its forward (``Case``'s fields)."""
    hv = (n + v) * h
    return {
        "grads": ("hidden", "weight"),
        "input_bytes": 2.0 * hv * e + 20.0 * n,
        "truth_bytes": _lm_head_truth_bytes(n, h, v, 2),
        "bytes_fwd": hv * e,
        "flops_fwd": 2.0 * n * h * v,
    }


# TRL 1.16's settings of each loss type in the family rows (GRPOConfig's defaults: epsilon 0.2, epsilon_high None =
# epsilon, the SAPO temperatures and VESPO shapes; CISPO's cap at 1.28) and their fasttnt PolicyLossConfig, mapped as
# fasttnt.integrations.trl maps them: loss type -> (TRL's loss_type, importance_sampling_level, fasttnt's settings)
FAMILY = {
    "gspo": ("grpo", "sequence", dict(policy_loss="gspo", agg="seq-mean-token-mean")),
    "cispo": ("cispo", "token", dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28)),
    "sapo": ("sapo", "token", dict(policy_loss="sapo", agg="seq-mean-token-mean")),
    "vespo": ("vespo", "token", dict(policy_loss="vespo")),
}
FAMILY_EPSILON, CISPO_CAP = 0.2, 1.28


def trl_family_loss(loss: str, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, cu: torch.Tensor):
    """TRL 1.16's loss of ``FAMILY[loss]``'s loss_type in torch (GRPOTrainer._compute_loss and get_gamma_weights,
    trl/trainer/grpo_trainer.py), on packed tokens: logp, old (N,), adv (S,), cu (S+1,)."""
    lengths = cu.diff()
    n, s = logp.shape[0], lengths.shape[0]
    seq = torch.repeat_interleave(torch.arange(s, device=logp.device), lengths, output_size=n)  # (N,)
    a = adv[seq]  # (N,)

    def per_sequence_sum(x):  # (N,) -> (S,)
        return torch.zeros(s, dtype=x.dtype, device=x.device).index_add(0, seq, x)

    log_ratio = logp - old
    if loss == "gspo":  # grpo with one ratio per sequence from its mean log-ratio
        coef_1 = torch.exp(per_sequence_sum(log_ratio) / lengths.clamp(min=1))[seq]
        coef_2 = torch.clamp(coef_1, 1 - FAMILY_EPSILON, 1 + FAMILY_EPSILON)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    elif loss == "cispo":
        per_token = -torch.clamp(torch.exp(log_ratio), max=CISPO_CAP).detach() * a * logp
    elif loss == "sapo":
        tau = torch.where(a > 0, 1.0, 1.05)
        per_token = -torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * 4 / tau * a
    else:  # vespo: the gamma weight of the sequence's summed, clamped log-ratio (k, lambda by the sign of A)
        with torch.no_grad():
            log_w = per_sequence_sum(torch.clamp(log_ratio, -20.0, 20.0)).clamp(math.log(1e-8), 20.0)
            k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi[seq] * a * logp
    if loss in ("gspo", "sapo"):  # grpo's aggregation: each sequence's token mean, then the mean over sequences
        return (per_sequence_sum(per_token) / lengths.clamp(min=1)).sum() / s
    return per_token.sum() / n  # dapo's: the tokens' sum over the batch's tokens


def loss_family_case(n: int, h: int, v: int, dtype, device, mean_len: int, loss: str) -> Case:
    """``linear_loss_case`` for one of the other policy losses (``FAMILY``), against TRL's and Liger's."""
    from fasttnt_kernels import PolicyLossConfig, clipped_policy_loss_reference

    e = torch.empty((), dtype=dtype).element_size()
    bounds = _packed_layout(n, mean_len, seed=n)
    loss_type, level, settings = FAMILY[loss]
    config = PolicyLossConfig(**settings)
    # log-ratios over [-0.6, 0.6] as linear_loss_case's (both of CISPO's and SAPO's sides act, and GSPO's mean of
    # ~mean_len of them lands inside its clip), kept 0.05 from each kink (CISPO's cap); VESPO reads each sequence's
    # sum: a spread of 1 / sqrt(mean_len) puts it around 0, where its weight is not ~0
    spread = 1.0 / mean_len**0.5 if loss == "vespo" else 0.6

    def make():
        x = _lm_head_inputs(n, h, v, dtype, device)
        cu = _cu_seqlens(bounds, device)
        logp64 = _lm_head_logp64(x["hidden"].detach(), x["weight"].detach(), x["ids"])
        log_ratio = _log_ratios_off(n, spread, (math.log(CISPO_CAP),), device)  # (N,)
        return {**x, "cu": cu, "adv": torch.randn(len(bounds), device=device), "old": (logp64 - log_ratio).float(),
                "logp64": logp64}  # fmt: skip

    def policy_loss(x, logp64):
        logp = logp64.clone().requires_grad_()
        value, _ = clipped_policy_loss_reference(logp, x["old"].double(), x["adv"].double(), x["cu"], config=config)
        value.backward()
        return value.detach(), logp.grad

    def fused():
        from fasttnt_kernels import PolicyLossInputs, linear_policy_loss

        def call(x):
            inputs = PolicyLossInputs(x["adv"], x["cu"], old_logp=x["old"])
            return linear_policy_loss(x["hidden"], x["weight"], x["ids"], inputs, config=config)[0]

        return call, ""

    def trl():
        logprobs, note = _trl_chunked_logprobs()

        def call(x):
            return trl_family_loss(loss, logprobs(x["hidden"], x["weight"], x["ids"]), x["old"], x["adv"], x["cu"])

        return call, note

    def liger():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # eager: Liger compiles only its loss math (elementwise over a chunk's log-probs) and its lm_head chunk loop is
        # the same either way; a compile per loss type (~20 s) would not fit gpu_check.sh's budget
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, compiled=False, loss_type=loss_type, importance_sampling_level=level,
            epsilon_low=FAMILY_EPSILON, epsilon_high=CISPO_CAP if loss == "cispo" else FAMILY_EPSILON,
        )  # fmt: skip
        lengths = torch.tensor([end - start for start, end in bounds], device=device)
        valid = torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None]  # (B, T)

        def padded(t):  # packed (N, ...) -> (B, T, ...), zeros where padded (differentiable)
            return t.new_zeros((*valid.shape, *t.shape[1:])).index_put((valid,), t)

        def call(x):
            out, _ = liger_loss(padded(x["hidden"]), x["weight"], padded(x["ids"]), valid.long(), x["adv"],
                                old_per_token_logps=padded(x["old"]))  # fmt: skip
            return out

        return call, f"{_version('liger-kernel')}: LigerFusedLinearGRPOLoss({loss_type}), eager, padded in the call"

    hv = (n + v) * h
    providers = [
        Provider("fasttnt", fused, extra_bytes=hv * 4.0 + 2 * 512 * 2**20),
        Provider("trl", trl, extra_bytes=hv * 4.0 + 2 * 4096 * TRL_VOCAB_CHUNK * e),
        Provider("liger", liger, extra_bytes=hv * 4.0 + 4 * n * h * e + 2 * mean_len * v * 4.0),
    ]
    return Case(
        "linear_policy_loss",
        f"loss={loss} N={n} H={h} V={v} S={len(bounds)} {_dtype_name(dtype)}",
        dtype,
        make,
        _lm_head_check({"main": policy_loss}, {"main": lambda x: float(x["adv"].abs().mean())}),
        providers,
        **_lm_head_loss_costs(n, h, v, e),
    )


def loss_case(n_seq: int, mean_len: int, device) -> Case:
    from fasttnt_kernels import clipped_policy_loss, clipped_policy_loss_reference

    bounds = _packed_layout(n_seq * mean_len, mean_len, seed=n_seq)
    n = bounds[-1][1]

    def make():
        logp = (-torch.rand(n, device=device) * 3).requires_grad_()
        old = logp.detach() + torch.randn(n, device=device) * 0.2
        return {
            "logp": logp,
            "old": old,
            "adv": torch.randn(len(bounds), device=device),
            "cu": _cu_seqlens(bounds, device),
        }

    def check(x, out, truth, cache):
        if "loss" not in cache:
            logp = x["logp"].detach().double().requires_grad_()
            loss, _ = clipped_policy_loss_reference(logp, x["old"].double(), x["adv"].double(), x["cu"])
            loss.backward()
            cache["loss"] = (loss.detach(), logp.grad)
        loss, grad = cache["loss"]
        floor = float(x["adv"].abs().mean())
        return rel_err([(out, loss)], floor=floor), rel_err([(x["logp"].grad, grad)])

    def fasttnt():
        return (lambda x: clipped_policy_loss(x["logp"], x["old"], x["adv"], x["cu"])[0]), ""

    def reference():
        return (lambda x: clipped_policy_loss_reference(x["logp"], x["old"], x["adv"], x["cu"])[0]), ""

    return Case(
        "clipped_policy_loss",
        f"S={len(bounds)} N={n}",
        torch.float32,
        make,
        check,
        [Provider("fasttnt", fasttnt), Provider("torch", reference)],
        grads=("logp",),
        input_bytes=20.0 * n,
        truth_bytes=32.0 * n,
        bytes_fwd=12.0 * n,
    )


def advantage_case(g: int, k: int, device) -> Case:
    from fasttnt_kernels import group_advantages, group_advantages_reference

    def make():
        return {"rewards": torch.randint(-2, 3, (g * k,), device=device).float()}

    def check(x, out, truth, cache):
        return rel_err([(out, group_advantages_reference(x["rewards"].double(), k))]), math.nan

    def compiled():
        fn = torch.compile(group_advantages_reference, dynamic=False)
        return (lambda x: fn(x["rewards"], k)), ""

    providers = [
        Provider("fasttnt", lambda: ((lambda x: group_advantages(x["rewards"], k)), "")),
        Provider("torch", lambda: ((lambda x: group_advantages_reference(x["rewards"], k)), "")),
        Provider("torch.compile", compiled),
    ]
    return Case(
        "group_advantages",
        f"G={g} K={k}",
        torch.float32,
        make,
        check,
        providers,
        input_bytes=8.0 * g * k,
        truth_bytes=32.0 * g * k,
        bytes_fwd=8.0 * g * k,
    )


def mode_advantage_case(g: int, k: int, device) -> Case:
    from fasttnt_kernels import mode_advantages, mode_advantages_reference

    def make():
        return {
            "rewards": torch.randint(-2, 3, (g * k,), device=device).float(),
            "non_thinking": torch.rand(g * k, device=device) < 0.5,
        }

    def check(x, out, truth, cache):
        ref = mode_advantages_reference(x["rewards"].double(), x["non_thinking"], k)
        return rel_err([(out.answer, ref.answer), (out.mode, ref.mode)]), math.nan

    providers = [
        Provider("fasttnt", lambda: ((lambda x: mode_advantages(x["rewards"], x["non_thinking"], k)), "")),
        Provider("torch", lambda: ((lambda x: mode_advantages_reference(x["rewards"], x["non_thinking"], k)), "")),
    ]
    return Case(
        "mode_advantages",
        f"G={g} K={k}",
        torch.float32,
        make,
        check,
        providers,
        input_bytes=5.0 * g * k,
        truth_bytes=33.0 * g * k,
        bytes_fwd=13.0 * g * k,
    )


def reward_case(g: int, k: int, mean_len: int, device) -> Case:
    from fasttnt_kernels import tnt_rewards, tnt_rewards_reference

    # g k responses of 0 to 2 mean_len tokens: empty ones too, which the reward must count as wrong
    lengths = torch.randint(0, 2 * mean_len, (g * k,), generator=torch.Generator().manual_seed(g))
    n = int(lengths.sum())

    def make():
        cu = torch.zeros(g * k + 1, dtype=torch.int64, device=device)
        cu[1:] = lengths.cumsum(0).to(device)
        ids = torch.randint(0, 1000, (n,), device=device)
        return {"ids": ids, "cu": cu, "correct": torch.rand(g * k, device=device) < 0.5}

    def check(x, out, truth, cache):
        # integer semantics: the plain-PyTorch reference is the truth
        ref = tnt_rewards_reference(x["ids"], x["cu"], x["correct"], k, 7).rewards
        return rel_err([(out, ref.double())]), math.nan

    providers = [
        Provider("fasttnt", lambda: ((lambda x: tnt_rewards(x["ids"], x["cu"], x["correct"], k, 7).rewards), "")),
        Provider(
            "torch", lambda: ((lambda x: tnt_rewards_reference(x["ids"], x["cu"], x["correct"], k, 7).rewards), "")
        ),
    ]
    return Case(
        "tnt_rewards",
        f"G={g} K={k} N={n}",
        torch.float32,
        make,
        check,
        providers,
        input_bytes=8.0 * n + 9.0 * g * k,
        truth_bytes=40.0 * n,
        bytes_fwd=8.0 * n,
    )


# -- measuring --------------------------------------------------------------------------------------------------


def _time_ms(fn, device) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds. On the CPU (--smoke only) one run: it checks the code path, and CPU times
    are not kernel speed."""
    if device.type == "cuda":
        import triton

        q = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return q[0], q[1], q[2]
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return ms, ms, ms


def free_bytes(device, limit_gib: float | None) -> float:
    """Memory a case may use: free device memory (plus what PyTorch's allocator holds unused), or the machine's
    available memory on the CPU; at most ``limit_gib``."""
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + held
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free if limit_gib is None else min(free, limit_gib * GIB)


def _too_big(need: float, device, limit_gib) -> str | None:
    free = free_bytes(device, limit_gib)
    if need <= MEMORY_HEADROOM * free:
        return None
    return f"needs ~{need / GIB:.3g} GiB, {free / GIB:.3g} GiB free"


def measure(case: Case, provider: Provider, call, inputs: dict, cache: dict, device) -> dict:
    grads = [inputs[k] for k in case.grads]

    def run_backward(out, retain: bool = False):
        # per-token outputs get the case's random upstream gradient, scalar losses 1
        out.backward(inputs["upstream"] if out.dim() else None, retain_graph=retain)

    def forward():
        return call(inputs)

    def fwd_bwd():
        for t in grads:
            t.grad = None
        run_backward(call(inputs))

    row: dict = {"op": case.op, "shape": case.shape, "provider": provider.name}
    # correctness first, on this very case: one forward (+ backward), against the float64 truth; an op without
    # gradients runs under no_grad as it is timed, so torch.compile makes one graph, not two
    if grads:
        out = forward()
        run_backward(out)
        out = out.detach()
    else:
        with torch.no_grad():
            out = forward()
    tol = TOLERANCE[case.dtype]
    missing = [k for k in case.grads if inputs[k].grad is None]
    if missing:
        out_err, grad_err = math.inf, math.inf
        row["note"] = f"no gradient reached {', '.join(missing)}"
    else:
        out_err, grad_err = case.check(inputs, out, provider.truth, cache)
        # written so that a NaN error fails: every comparison with NaN is False
        passed = out_err <= tol and (not case.grads or grad_err <= tol)
        row["note"] = "" if passed else f"error above {tol:.3g} against float64"
    del out
    row["out_err"], row["grad_err"] = out_err, grad_err
    row["status"] = "FAIL" if row["note"] else "ok"

    with torch.no_grad():
        row["fwd_ms"], row["fwd_p20"], row["fwd_p80"] = _time_ms(forward, device)
    if grads:
        row["fwd_bwd_ms"], row["fwd_bwd_p20"], row["fwd_bwd_p80"] = _time_ms(fwd_bwd, device)
        for t in grads:
            t.grad = None
        out = call(inputs)
        try:
            row["bwd_ms"], _, _ = _time_ms(lambda: run_backward(out, retain=True), device)
        except RuntimeError:  # an in-place backward cannot run twice on one graph: report fwd+bwd only
            row["bwd_ms"] = math.nan
        del out
    row["fwd_gbps"] = case.bytes_fwd / (row["fwd_ms"] * 1e-3) / 1e9
    if device.type == "cuda":
        row["fwd_pct_copy_bw"] = 100 * row["fwd_gbps"] / H200_COPY_GBPS
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for t in grads:
            t.grad = None
        base = torch.cuda.memory_allocated()
        fwd_bwd() if grads else forward()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if case.flops_fwd:
        row["fwd_tflops"] = case.flops_fwd / (row["fwd_ms"] * 1e-3) / 1e12
        if "fwd_bwd_ms" in row:
            row["fwd_bwd_tflops"] = 3 * case.flops_fwd / (row["fwd_bwd_ms"] * 1e-3) / 1e12  # the useful 3 matmuls
        if device.type == "cuda":
            row["fwd_pct_bf16_peak"] = 100 * row["fwd_tflops"] / H200_BF16_TFLOPS
    for t in grads:
        t.grad = None
    return row


def _unmeasured(case: Case, provider: Provider, status: str, note: str) -> dict:
    """The row of a provider that was skipped or not run, with the reason."""
    return {"op": case.op, "shape": case.shape, "provider": provider.name, "status": status, "note": note}


def run_case(case: Case, device, args, report: Callable[[dict], None], deadline: float) -> None:
    """Make the case's tensors, check and time each provider, free the tensors. Every outcome is one row."""
    reason = _too_big(case.input_bytes + case.truth_bytes, device, args.memory_limit_gib)
    if reason:
        for provider in case.providers:
            report(_unmeasured(case, provider, "skipped", f"case {reason}"))
        return
    torch.manual_seed(0)
    try:
        inputs = case.make()
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        for provider in case.providers:
            report(_unmeasured(case, provider, "skipped", "out of memory making the inputs"))
        return
    cache: dict = {}  # the float64 truths, computed once per case
    for provider in case.providers:
        if time.monotonic() >= deadline:
            report(_unmeasured(case, provider, "not run", "past the --max-seconds deadline"))
            continue
        reason = _too_big(provider.extra_bytes + case.truth_bytes, device, args.memory_limit_gib)
        if reason:
            report(_unmeasured(case, provider, "skipped", reason))
            continue
        try:
            call, note = provider.setup()
        except ImportError as exc:
            report(_unmeasured(case, provider, "skipped", f"not importable: {exc}"))
            continue
        try:
            result = measure(case, provider, call, inputs, cache, device)
        except torch.OutOfMemoryError:
            note_oom = f"out of memory (estimated {provider.extra_bytes / GIB:.3g} GiB beside the inputs)"
            result = _unmeasured(case, provider, "skipped", note_oom)
        if note:
            result["note"] = f"{result['note']}; {note}" if result.get("note") else note
        report(result)
        del call
        for k in case.grads:
            inputs[k].grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del inputs, cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- peak memory of the fused lm_head path, measured in a fresh process (any Linux machine) ---------------------


_MEMORY_CHILD = """
import sys, torch
from fasttnt_kernels import PolicyLossInputs, linear_policy_loss, linear_token_logprobs
sys.path.insert(0, {here!r})
import proc_memory
from bench_kernels import TRL_VOCAB_CHUNK, materialised_linear_logprobs
n, h, v, how, chunk = {n}, {h}, {v}, {how!r}, {chunk}
torch.manual_seed(0)
hidden = torch.randn(n, h, requires_grad=True)
weight = (torch.randn(v, h) / h**0.5).requires_grad_()
ids = torch.randint(0, v, (n,))
if how == "trl":
    from trl.kernels import ChunkedLogProbFunction
# the window opens at the inputs: what was freed before it (randn's temporary, an import) is not the op's
peaks = proc_memory.Peaks()
peaks.start_window()
if how == "fused":
    linear_token_logprobs(hidden, weight, ids, chunk_bytes=chunk).sum().backward()
elif how == "loss":  # the update's whole loss: 4 sequences, token-mean, gradients formed in the forward
    cu = torch.linspace(0, n, 5).long()
    linear_policy_loss(hidden, weight, ids, PolicyLossInputs(torch.randn(4), cu), chunk_bytes=chunk)[0].backward()
elif how == "trl":  # TRL 1.16's GRPO log-prob path (its fused lm_head's chunked function)
    ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())[0].sum().backward()
else:
    materialised_linear_logprobs(hidden, weight, ids).sum().backward()
print(peaks.end_window()["rise_mib"])
"""
# the memory rows' processes: what each computes (module docstring's providers) and its planned bytes beyond the
# float32 inputs and gradients
_MEMORY_PROVIDERS = {
    "fused": "fasttnt ({chunk} MiB chunks)",
    "loss": "fasttnt linear_policy_loss ({chunk} MiB chunks)",
    "trl": "trl (ChunkedLogProbFunction)",
    "materialised": "torch (materialised)",
}


def start_peak_child(n: int, h: int, v: int, how: str, chunk_mib: int) -> subprocess.Popen:
    """A fresh process that prints the rise of its peak resident set (MiB) over one forward+backward, above the
    resident set at its start (benchmarks/proc_memory.py: Linux)."""
    code = _MEMORY_CHILD.format(here=str(HERE), n=n, h=h, v=v, how=how, chunk=chunk_mib * 2**20)
    env = dict(os.environ, FASTTNT_KERNELS="torch")
    # glibc's malloc, which returns large freed blocks to the system: a preloaded allocator that keeps them would let
    # the op reuse memory the window does not see
    env.pop("LD_PRELOAD", None)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def child_peak_mib(proc: subprocess.Popen) -> float:
    out, err = proc.communicate()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return float(out.strip().splitlines()[-1])


def memory_rows(args, report: Callable[[dict], None], deadline: float) -> None:
    h, v = args.memory_hidden, args.vocab
    for n in args.memory_tokens:
        logits_mib = n * v * 4 / 2**20
        # the fused and the materialised process of one N run side by side: a high-water mark is per process, so this
        # changes no number and halves the wait (most of which is each process importing torch)
        started, planned = [], 0.0
        for how, provider in _MEMORY_PROVIDERS.items():
            if how == "trl" and not _importable("trl"):
                continue
            row = {
                "op": "linear_token_logprobs",
                "shape": f"N={n} H={h} V={v} float32",
                "provider": provider.format(chunk=args.chunk_mib),
                "logits_mib": logits_mib,
            }
            # float32 inputs and gradients, plus a chunk of logits (a tile of 4096 x 32K for TRL); the materialised
            # path holds logits, softmax and gradient
            chunked = {"trl": 3 * 4.0 * 4096 * TRL_VOCAB_CHUNK}.get(how, 3 * args.chunk_mib * 2**20)
            need = 8.0 * (n + v) * h + (3 * 4.0 * n * v if how == "materialised" else chunked)
            reason = _too_big(planned + need, torch.device("cpu"), args.memory_limit_gib)
            if time.monotonic() >= deadline:
                report({**row, "status": "not run", "note": "past the --max-seconds deadline"})
            elif not proc_memory.available():
                report({**row, "status": "skipped", "note": "the peak is read from /proc's high-water marks: Linux"})
            elif reason:
                report({**row, "status": "skipped", "note": reason})
            else:
                started.append((row, start_peak_child(n, h, v, how, args.chunk_mib)))
                planned += need
        for row, proc in started:
            report({**row, "peak_mib": child_peak_mib(proc), "status": "ok"})


# -- results: printed and appended to the CSV one row at a time -------------------------------------------------


# The CSV's columns; status, out_err, grad_err and note came with the correctness checks and the skipped rows (an
# older file gets them, empty, on its next append).
# fmt: off
FIELDS = [
    "date", "device", "torch", "triton", "command", "op", "shape", "provider",
    "fwd_ms", "fwd_p20", "fwd_p80", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_p20", "fwd_bwd_p80",
    "fwd_gbps", "fwd_pct_copy_bw", "fwd_tflops", "fwd_bwd_tflops", "fwd_pct_bf16_peak", "peak_mib", "logits_mib",
    "status", "out_err", "grad_err", "note",
]
# fmt: on


class CsvLog:
    """Appends rows to a CSV, each written and flushed on its own, so a run stopped by a timeout keeps every row it
    measured. A file written before the newer columns existed is rewritten once with them (empty for old rows)."""

    def __init__(self, path: Path, stamp: dict):
        self.path, self.stamp = path, stamp
        if path.exists() and path.stat().st_size:
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                old_fields, old_rows = reader.fieldnames or [], list(reader)
            if old_fields != FIELDS:
                with path.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
                    writer.writeheader()
                    writer.writerows(old_rows)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="") as f:
                csv.DictWriter(f, fieldnames=FIELDS).writeheader()

    def write(self, row: dict) -> None:
        # NaN (no gradient to compare, no repeatable backward) is an empty cell, as a column the row lacks
        values = {k: ("" if math.isnan(v) else f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}
        with self.path.open("a", newline="") as f:  # closed, so flushed, before the next row is measured
            csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore").writerow({**self.stamp, **values})


def _print_row(row: dict) -> None:
    head = f"  {row['op']:<22} {row['shape']:<36} {row['provider']:<30} {row.get('status', ''):<8}"
    if "fwd_ms" in row:
        head += f" fwd {row['fwd_ms']:9.3f} ms"
        if "fwd_bwd_ms" in row:
            head += f"  fwd+bwd {row['fwd_bwd_ms']:9.3f} ms"
        if "peak_mib" in row:
            head += f"  peak {row['peak_mib']:8.0f} MiB"
        head += f"  err {row['out_err']:.2g}" + (f"/{row['grad_err']:.2g}" if not math.isnan(row["grad_err"]) else "")
    elif "peak_mib" in row:
        head += f" peak +{row['peak_mib']:8.0f} MiB (one N x V float32 logits tensor: {row['logits_mib']:.0f} MiB)"
    if row.get("note"):
        head += f"  ({row['note']})"
    print(head, flush=True)


def build_cases(args, device) -> list[Case]:
    """Every case, in the order they run, most telling first so that a deadline drops the rest: at the first token
    count the lm_head ops width by width (the fused loss first, the other policy losses after it at the first
    width, the logits op after the first width), the cheap ops, then the lm_head ops at the other token counts."""
    chosen = set(args.providers.split(","))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mean_len = 8 if args.smoke else 1024  # GRPO responses: hundreds to thousands of tokens

    def lm_head_cases(n: int, family: bool = False) -> list[Case]:
        cases = []
        for i, h in enumerate(args.hidden):
            cases += [linear_loss_case(n, h, args.vocab, dtype, device, mean_len)]
            if family and i == 0:  # the other policy losses beside the first vanilla row
                cases += [loss_family_case(n, h, args.vocab, dtype, device, mean_len, loss) for loss in FAMILY]
            cases += [linear_case(n, h, args.vocab, dtype, device, mean_len)]
            if i == 0:
                cases += [token_logprob_case(n, args.vocab, dtype, device, mean_len)]
        return cases

    if args.losses_only:  # the policy losses alone, at every shape: on the CPU, their checks and one timed run
        cases = [
            case
            for n in args.tokens
            for h in args.hidden
            for case in [
                linear_loss_case(n, h, args.vocab, dtype, device, mean_len),
                *(loss_family_case(n, h, args.vocab, dtype, device, mean_len, loss) for loss in FAMILY),
            ]
        ]
        return _chosen_providers(cases, chosen)
    cases = lm_head_cases(args.tokens[0], family=True)
    if args.smoke:
        cases += [loss_case(3, 16, device), advantage_case(2, 4, device), mode_advantage_case(2, 4, device)]
        cases += [reward_case(2, 4, 8, device)]
    else:
        cases += [loss_case(max(1, n // 512), 512, device) for n in args.tokens]
        cases += [advantage_case(g, 16, device) for g in (128, 1024)]
        cases += [mode_advantage_case(g, 16, device) for g in (128, 1024)]
        cases += [reward_case(g, 16, 2048, device) for g in (128, 1024)]
    for n in args.tokens[1:]:
        cases += lm_head_cases(n)
    return _chosen_providers(cases, chosen)


def _chosen_providers(cases: list[Case], chosen: set[str]) -> list[Case]:
    """The cases with fasttnt's rows, which always run, and the baselines --providers names."""
    for case in cases:
        case.providers = [p for p in case.providers if p.name.startswith("fasttnt") or _family(p.name) in chosen]
    return cases


def _family(provider: str) -> str:
    """The --providers name of a row's provider: "torch.compile (materialised)" -> "compile", "liger ..." ->
    "liger"."""
    first = provider.split(" ")[0]
    return "compile" if first == "torch.compile" else first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--providers", default=None, help="baselines beside fasttnt (default trl,torch,compile,liger)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 4096])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1536, 3584], help="1.5B and 7B widths")
    parser.add_argument("--vocab", type=int, default=151936, help="the Qwen2 vocabulary")
    parser.add_argument("--memory-only", action="store_true", help="only the fused-vs-materialised peak memory")
    parser.add_argument("--memory-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--memory-hidden", type=int, default=1536)
    parser.add_argument(
        "--chunk-mib",
        type=int,
        default=None,
        help="the fused ops' logits per chunk in the memory rows (default: the trainer's on this "
        "device, fasttnt_kernels' default_chunk_bytes: 512 MiB on CUDA, 256 MiB on the CPU)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks every code path runs")
    parser.add_argument(
        "--losses-only",
        action="store_true",
        help="the policy losses alone (vanilla, gspo, cispo, sapo, vespo) at --tokens x --hidden, on any device (the "
        "CPU: their checks against float64 and one timed run each, which is not kernel speed)",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="start no case or provider after this")
    parser.add_argument("--memory-limit-gib", type=float, default=None, help="plan with at most this much memory")
    parser.add_argument("--csv", type=Path, default=None, help="default benchmarks/results.csv; none for --smoke")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_seconds if args.max_seconds is not None else math.inf
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.tokens, args.hidden, args.vocab = [24], [16], 300
        args.memory_tokens, args.memory_hidden = [64], 32
        # torch.compile costs ~20 s per shape on the CPU: asked for by name only
        args.providers = args.providers or "trl,torch,liger"
    args.providers = args.providers or "trl,torch,compile,liger"
    csv_path = args.csv or (None if args.smoke else HERE / "results.csv")
    if args.chunk_mib is None:  # the timed rows call the ops without chunk_bytes: the same default
        from fasttnt_kernels._lm_head import default_chunk_bytes

        args.chunk_mib = default_chunk_bytes(device) // 2**20

    import triton

    stamp = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["bench_kernels.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    log = CsvLog(csv_path, stamp) if csv_path else None
    rows: list[dict] = []

    def report(row: dict) -> None:
        rows.append(row)
        _print_row(row)
        if log:
            log.write(row)

    if (device.type != "cuda" and not args.losses_only) or args.memory_only:
        print("peak memory of one forward+backward (a fresh CPU process each: algorithmic, it holds on any device)")
        memory_rows(args, report, deadline)
    if (device.type == "cuda" or args.smoke or args.losses_only) and not args.memory_only:
        print(f"kernels on {stamp['device']}: status, times, and error against float64 (output/gradients)")
        for case in build_cases(args, device):
            if time.monotonic() >= deadline:
                for provider in case.providers:
                    report(_unmeasured(case, provider, "not run", "past the --max-seconds deadline"))
                continue
            run_case(case, device, args, report, deadline)
    not_run = [r for r in rows if r.get("status") == "not run"]
    if not_run:
        print(f"not run, past the {args.max_seconds:g} s deadline ({len(not_run)} rows):")
        for r in not_run:
            print(f"  {r['op']} {r['shape']} {r['provider']}")
    skipped = [r for r in rows if r.get("status") == "skipped"]
    if skipped or not_run:  # one line per reason, so a summary (gpu_check.sh) never reads them as measured
        reasons: dict[str, int] = {}
        for r in skipped:
            reasons[r["note"]] = reasons.get(r["note"], 0) + 1
        for note, count in reasons.items():
            print(f"SKIPPED: {count} rows: {note}")
        if not_run:
            print(f"SKIPPED: {len(not_run)} rows not run, past the --max-seconds deadline")
    failed = [r for r in rows if r.get("status") == "FAIL"]
    print(
        f"{len(rows)} rows in {time.monotonic() - started:.0f} s: {sum(r.get('status') == 'ok' for r in rows)} ok, "
        f"{len(failed)} FAIL, {sum(r.get('status') == 'skipped' for r in rows)} skipped, {len(not_run)} not run"
        + (f"; appended to {csv_path}" if csv_path else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
