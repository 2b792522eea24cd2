"""What every op shares: choosing Triton or the reference, input checks, settings errors, and output allocation."""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "FASTTNT_KERNELS"
_BACKENDS = ("auto", "triton", "torch")
# log-ratios are clamped to +-this before exp (the policy loss's ratio and KL, the rollout correction's weights):
# exp(20) = 4.9e8 is far past any clip bound or cap, and far from float32's overflow at exp(88.7)
LOG_RATIO_CLAMP = 20.0


class SettingError(ValueError):
    """A hyper-parameter out of its range. ``key`` names the setting as the op calls it and ``why`` says what it
    must be, so a caller that holds the value under a name of its own (a trainer's ``loss.clip_high``) can name its
    key with the op's own reason instead of checking the range a second time."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key} {why}")
        self.key, self.why = key, why


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
