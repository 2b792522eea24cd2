"""Kernel speed and memory against the PyTorch formulations GRPO trainers use, torch.compile, and Liger-Kernel.

    python benchmarks/bench_kernels.py                      # CUDA: every op at the shapes that matter
    python benchmarks/bench_kernels.py --memory-only        # any device: peak memory of the fused lm_head path
    python benchmarks/bench_kernels.py --smoke              # tiny shapes, every code path (CPU: interpreter)

Times are medians (and 20th/80th percentiles) of ``triton.testing.do_bench`` on CUDA, reported with achieved GB/s
against the measured copy bandwidth and, for the fused linear op, TFLOP/s against the measured bf16 matmul rate.
On the CPU only memory is reported: it is algorithmic and holds on any device; CPU times are not kernel speed.
Rows are appended to ``benchmarks/results.csv`` with the device, date, versions and command.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# Ceilings measured on an H200 (../shared/DESIGN.md): device copy and dense bf16 matmul.
H200_COPY_GBPS = 4300.0
H200_BF16_TFLOPS = 790.0


# -- the formulations we compare against ----------------------------------------------------------------------


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The eager pattern GRPO trainers use (TRL's ``selective_log_softmax``): the chosen logit minus the row's
    log-sum-exp for 32-bit logits; row-wise log_softmax for 16-bit ones, to keep memory at one row."""
    if logits.dtype in (torch.float32, torch.float64):
        chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return chosen - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack(
        [
            torch.log_softmax(row.float(), dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1)
            for row, i in zip(logits, ids, strict=True)
        ]
    )


def materialised_linear_logprobs(hidden, weight, ids):
    """Materialise the logits, then gather: what a trainer without a fused lm_head does."""
    return selective_log_softmax(hidden @ weight.T, ids)


@dataclass
class Case:
    op: str
    shape: str
    provider: str
    fn: Callable[[], torch.Tensor]  # runs the forward, returns the output to backprop
    inputs: list[torch.Tensor]  # what needs .grad reset between runs
    bytes_fwd: float  # DRAM bytes the forward must move at least
    flops_fwd: float = 0.0


def _providers(args) -> list[str]:
    chosen = args.providers.split(",")
    if "liger" in chosen:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            print("liger-kernel not installed: skipping its rows", file=sys.stderr)
            chosen.remove("liger")
    return chosen


def token_logprob_cases(n: int, v: int, dtype, device, providers) -> list[Case]:
    from fasttnt_kernels import token_logprobs

    logits = torch.randn(n, v, device=device, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, v, (n,), device=device)
    bytes_fwd = n * v * logits.element_size()
    shape = f"N={n} V={v} {str(dtype).removeprefix('torch.')}"
    cases = [Case("token_logprobs", shape, "fasttnt", lambda: token_logprobs(logits, ids), [logits], bytes_fwd)]
    if "torch" in providers:
        cases.append(
            Case("token_logprobs", shape, "torch", lambda: selective_log_softmax(logits, ids), [logits], bytes_fwd)
        )
    if "compile" in providers:
        compiled = torch.compile(selective_log_softmax, dynamic=False)
        cases.append(Case("token_logprobs", shape, "torch.compile", lambda: compiled(logits, ids), [logits], bytes_fwd))
    return cases


def linear_cases(n: int, h: int, v: int, dtype, device, providers) -> list[Case]:
    from fasttnt_kernels import linear_token_logprobs

    hidden = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_()
    ids = torch.randint(0, v, (n,), device=device)
    shape = f"N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}"
    bytes_fwd = (n * h + v * h) * hidden.element_size()
    flops = 2.0 * n * h * v
    inputs = [hidden, weight]
    cases = [
        Case(
            "linear_token_logprobs",
            shape,
            "fasttnt",
            lambda: linear_token_logprobs(hidden, weight, ids),
            inputs,
            bytes_fwd,
            flops,
        )
    ]
    if "torch" in providers:
        cases.append(
            Case(
                "linear_token_logprobs",
                shape,
                "torch (materialised)",
                lambda: materialised_linear_logprobs(hidden, weight, ids),
                inputs,
                bytes_fwd,
                flops,
            )
        )
    if "compile" in providers:
        compiled = torch.compile(materialised_linear_logprobs, dynamic=False)
        cases.append(
            Case(
                "linear_token_logprobs",
                shape,
                "torch.compile (materialised)",
                lambda: compiled(hidden, weight, ids),
                inputs,
                bytes_fwd,
                flops,
            )
        )
    if "liger" in providers:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # Liger fuses the lm_head with its whole GRPO loss; we time its loss against our log-probs alone, so the
        # row says how the fused lm_head paths compare, not two identical computations
        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
        adv = torch.randn(1, device=device)
        mask = torch.ones(1, n, device=device)

        def liger_fn():
            return liger(hidden.unsqueeze(0), weight, ids.unsqueeze(0), mask, adv)[0]

        cases.append(
            Case("linear_token_logprobs", shape, "liger (fused GRPO loss)", liger_fn, inputs, bytes_fwd, flops)
        )
    return cases


def advantage_cases(g: int, k: int, device, providers) -> list[Case]:
    from fasttnt_kernels import group_advantages, group_advantages_reference

    rewards = torch.randint(-2, 3, (g * k,), device=device).float()
    shape = f"G={g} K={k}"
    cases = [Case("group_advantages", shape, "fasttnt", lambda: group_advantages(rewards, k), [], 8.0 * g * k)]
    if "torch" in providers:
        cases.append(
            Case("group_advantages", shape, "torch", lambda: group_advantages_reference(rewards, k), [], 8.0 * g * k)
        )
    if "compile" in providers:
        compiled = torch.compile(group_advantages_reference, dynamic=False)
        cases.append(Case("group_advantages", shape, "torch.compile", lambda: compiled(rewards, k), [], 8.0 * g * k))
    return cases


def loss_cases(n_seq: int, mean_len: int, device, providers) -> list[Case]:
    from fasttnt_kernels import clipped_policy_loss, clipped_policy_loss_reference

    lengths = torch.randint(1, 2 * mean_len, (n_seq,), device=device)
    cu = torch.zeros(n_seq + 1, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    logp = (-torch.rand(n, device=device) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, device=device) * 0.2
    adv = torch.randn(n_seq, device=device)
    shape = f"S={n_seq} N={n}"
    cases = [
        Case(
            "clipped_policy_loss",
            shape,
            "fasttnt",
            lambda: clipped_policy_loss(logp, old, adv, cu)[0],
            [logp],
            12.0 * n,
        )
    ]
    if "torch" in providers:
        cases.append(
            Case(
                "clipped_policy_loss",
                shape,
                "torch",
                lambda: clipped_policy_loss_reference(logp, old, adv, cu)[0],
                [logp],
                12.0 * n,
            )
        )
    return cases


def reward_cases(g: int, k: int, mean_len: int, device, providers) -> list[Case]:
    from fasttnt_kernels import tnt_rewards, tnt_rewards_reference

    lengths = torch.randint(0, 2 * mean_len, (g * k,), device=device)
    cu = torch.zeros(g * k + 1, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    ids = torch.randint(0, 1000, (int(cu[-1]),), device=device)
    correct = torch.rand(g * k, device=device) < 0.5
    shape = f"G={g} K={k} N={int(cu[-1])}"
    nbytes = 8.0 * int(cu[-1])
    cases = [Case("tnt_rewards", shape, "fasttnt", lambda: tnt_rewards(ids, cu, correct, k, 7).rewards, [], nbytes)]
    if "torch" in providers:
        cases.append(
            Case(
                "tnt_rewards", shape, "torch", lambda: tnt_rewards_reference(ids, cu, correct, k, 7).rewards, [], nbytes
            )
        )
    return cases


# -- measuring --------------------------------------------------------------------------------------------------


def _time_ms(fn, device) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds."""
    if device.type == "cuda":
        import triton

        q = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return q[0], q[1], q[2]
    import statistics
    import time

    fn()  # warm-up (compilation, allocator)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    runs.sort()
    return statistics.median(runs), runs[1], runs[-2]


def measure(case: Case, device) -> dict:
    def forward():
        return case.fn()

    def backward_setup():
        for t in case.inputs:
            t.grad = None
        return case.fn()

    def fwd_bwd():
        out = backward_setup()
        out.float().sum().backward()

    row = {"op": case.op, "shape": case.shape, "provider": case.provider}
    with torch.no_grad():
        row["fwd_ms"], row["fwd_p20"], row["fwd_p80"] = _time_ms(forward, device)
    if case.inputs:
        row["fwd_bwd_ms"], row["fwd_bwd_p20"], row["fwd_bwd_p80"] = _time_ms(fwd_bwd, device)
        out = backward_setup()
        grad = torch.ones_like(out.float()).to(out.dtype)

        def bwd_only():
            out.backward(grad, retain_graph=True)

        try:
            row["bwd_ms"], _, _ = _time_ms(bwd_only, device)
        except RuntimeError:  # an in-place backward cannot run twice on one graph: report fwd+bwd only
            row["bwd_ms"] = float("nan")
    row["fwd_gbps"] = case.bytes_fwd / (row["fwd_ms"] * 1e-3) / 1e9
    if device.type == "cuda":
        row["fwd_pct_copy_bw"] = 100 * row["fwd_gbps"] / H200_COPY_GBPS
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd() if case.inputs else forward()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if case.flops_fwd:
        row["fwd_tflops"] = case.flops_fwd / (row["fwd_ms"] * 1e-3) / 1e12
        if "fwd_bwd_ms" in row:
            row["fwd_bwd_tflops"] = 3 * case.flops_fwd / (row["fwd_bwd_ms"] * 1e-3) / 1e12  # the useful 3 matmuls
        if device.type == "cuda":
            row["fwd_pct_bf16_peak"] = 100 * row["fwd_tflops"] / H200_BF16_TFLOPS
    return row


# -- peak memory of the fused lm_head path, measured in a fresh process (any device) ----------------------------


_MEMORY_CHILD = """
import resource, sys, torch
from fasttnt_kernels import linear_token_logprobs
sys.path.insert(0, {here!r})
from bench_kernels import materialised_linear_logprobs
n, h, v, how, chunk = {n}, {h}, {v}, {how!r}, {chunk}
torch.manual_seed(0)
hidden = torch.randn(n, h, requires_grad=True)
weight = (torch.randn(v, h) / h**0.5).requires_grad_()
ids = torch.randint(0, v, (n,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if how == "fused":
    linear_token_logprobs(hidden, weight, ids, chunk_bytes=chunk).sum().backward()
else:
    materialised_linear_logprobs(hidden, weight, ids).sum().backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) / 1024)
"""


def cpu_peak_mib(n: int, h: int, v: int, how: str, chunk_mib: int) -> float:
    """Growth of the peak resident set (MiB) over one forward+backward, in a fresh process (ru_maxrss, Linux)."""
    code = _MEMORY_CHILD.format(here=str(HERE), n=n, h=h, v=v, how=how, chunk=chunk_mib * 2**20)
    env = dict(os.environ, FASTTNT_KERNELS="torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def memory_rows(args) -> list[dict]:
    rows = []
    for n in args.memory_tokens:
        for how in ("fused", "materialised"):
            mib = cpu_peak_mib(n, args.memory_hidden, args.vocab, how, args.chunk_mib)
            logits_mib = n * args.vocab * 4 / 2**20
            rows.append(
                {
                    "op": "linear_token_logprobs",
                    "shape": f"N={n} H={args.memory_hidden} V={args.vocab} float32",
                    "provider": f"fasttnt ({args.chunk_mib} MiB chunks)" if how == "fused" else "torch (materialised)",
                    "peak_mib": mib,
                    "logits_mib": logits_mib,
                }
            )
            print(
                f"  {rows[-1]['provider']:<22} {rows[-1]['shape']:<32} peak +{mib:8.0f} MiB "
                f"(one N x V float32 logits tensor: {logits_mib:.0f} MiB)",
                flush=True,
            )
    return rows


# -- main ---------------------------------------------------------------------------------------------------------


def append_csv(rows: list[dict], path: Path, device: torch.device) -> None:
    import triton

    stamp = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    fields = [
        "date",
        "device",
        "torch",
        "triton",
        "command",
        "op",
        "shape",
        "provider",
        "fwd_ms",
        "fwd_p20",
        "fwd_p80",
        "bwd_ms",
        "fwd_bwd_ms",
        "fwd_bwd_p20",
        "fwd_bwd_p80",
        "fwd_gbps",
        "fwd_pct_copy_bw",
        "fwd_tflops",
        "fwd_bwd_tflops",
        "fwd_pct_bf16_peak",
        "peak_mib",
        "logits_mib",
    ]
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**stamp, **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--providers", default="torch,compile,liger", help="baselines beside fasttnt")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1536, 3584], help="1.5B and 7B widths")
    parser.add_argument("--vocab", type=int, default=151936, help="the Qwen2 vocabulary")
    parser.add_argument("--memory-only", action="store_true", help="only the fused-vs-materialised peak memory")
    parser.add_argument("--memory-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--memory-hidden", type=int, default=1536)
    parser.add_argument("--chunk-mib", type=int, default=128, help="the fused op's logits budget per chunk")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks every code path runs")
    parser.add_argument("--csv", type=Path, default=HERE / "results.csv")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.tokens, args.hidden, args.vocab = [64], [32], 1000
        args.memory_tokens, args.memory_hidden = [64], 32
        args.providers = "torch"
    rows: list[dict] = []
    if device.type != "cuda" or args.memory_only:
        print(f"peak memory of one forward+backward (fresh process, {'CPU' if device.type != 'cuda' else 'CUDA'})")
        rows += memory_rows(args)
    if device.type == "cuda" or args.smoke:
        providers = _providers(args)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cases: list[Case] = []
        for n in args.tokens:
            cases += token_logprob_cases(n, args.vocab, dtype, device, providers)
            for h in args.hidden:
                cases += linear_cases(n, h, args.vocab, dtype, device, providers)
            cases += loss_cases(max(1, n // 512), 512, device, providers)
        for g in (128, 1024) if not args.smoke else (4,):
            cases += advantage_cases(g, 16, device, providers)
            cases += reward_cases(g, 16, 2048 if not args.smoke else 16, device, providers)
        for case in cases:
            row = measure(case, device)
            rows.append(row)
            print(
                f"  {row['op']:<22} {row['shape']:<34} {row['provider']:<30} fwd {row['fwd_ms']:8.3f} ms"
                + (f"  fwd+bwd {row['fwd_bwd_ms']:8.3f} ms" if "fwd_bwd_ms" in row else "")
                + (f"  peak {row['peak_mib']:8.0f} MiB" if "peak_mib" in row else ""),
                flush=True,
            )
    if not args.smoke:
        append_csv(rows, args.csv, device)
        print(f"appended {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
