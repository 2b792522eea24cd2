"""What every op shares: choosing Triton or the reference, input checks, and output allocation."""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "FASTTNT_KERNELS"
_BACKENDS = ("auto", "triton", "torch")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when an op should run its Triton kernels on these tensors.

    ``FASTTNT_KERNELS=triton`` or ``=torch`` forces a path; unset (or ``auto``) picks Triton exactly when every
    tensor lives on a CUDA device. Read at call time, so a test or a script can switch paths without re-importing.
    """
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r} is not one of {', '.join(_BACKENDS)}")
    if choice == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if choice == "auto":
        return on_cuda
    if not on_cuda and not interpreter_active():
        raise RuntimeError(
            f"{BACKEND_ENV}=triton was asked for on CPU tensors, which needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before fasttnt_kernels is imported (Triton reads it when the kernels are defined)"
        )
    return True


def interpreter_active() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def new_empty(shape: tuple[int, ...] | int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes in full is made here.

    One seam so the tests can poison all of them (NaN, or a sentinel integer) and prove each element was written.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32 for every input dtype except float64, which the references keep so the tests can use them as truth."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_1d(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} elements, got {t.shape[0]}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of {names}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all inputs must be on one device, got {listed}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


# -- the lm_head matmuls both lm_head ops run -------------------------------------------------------------------


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the lm_head matmul runs in: autocast's when it is on for this device, else the input's."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # the operands are already in the chosen dtype; autocast must not cast them again
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b, out=out)


def aggregation_weights(agg: str, norm_length: float | None, N: int, S: int, total_tokens, total_seqs):
    """(w_const, w_per_len) of a policy-loss aggregation, w_t = w_const + w_per_len / len_s (clipped_policy_loss's
    formulas; linear_policy_loss's too): token-mean 1 / tokens, seq-mean-token-mean 1 / (seqs len_s),
    seq-mean-token-sum-norm 1 / (seqs norm_length). ``total_tokens``/``total_seqs`` replace N/S when given."""
    tokens = float(N if total_tokens is None else total_tokens)
    seqs = float(S if total_seqs is None else total_seqs)
    if agg == "token-mean":
        return (1.0 / tokens if tokens > 0 else 0.0), 0.0
    if seqs <= 0:
        return 0.0, 0.0
    if agg == "seq-mean-token-mean":
        return 0.0, 1.0 / seqs
    return 1.0 / (seqs * norm_length), 0.0
