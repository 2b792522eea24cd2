"""What the two lm_head ops share (``linear_token_logprobs``, ``linear_policy_loss``): the chunk size and input
checks, the loop over row chunks, and the gradients its matmuls form.

Both run ``hidden @ weight.T`` a chunk of rows at a time, so that one chunk of logits (C x V) exists at once:
matmul 1 makes a chunk's logits, ``token_logprobs``' kernels (or its PyTorch path) turn them into log-probs and, in
place, into dloss/dlogits, and matmuls 2 and 3 add the chunk's share to the gradients of the hidden states and of
the weight. Under ``torch.autocast`` the matmuls run in the autocast dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .token_logprobs import check_logprob_inputs, launchers

DEFAULT_CHUNK_BYTES = 512 * 2**20
"""Logits bytes per chunk on a GPU: 512 MiB is ~1,700 rows of a bf16 152K vocabulary, enough rows to keep the
matmul efficient while the logits stay a small fraction of a GPU's memory."""

DEFAULT_CPU_CHUNK_BYTES = 256 * 2**20
"""Logits bytes per chunk elsewhere: 384 rows of a float32 152K vocabulary. On a 2-core CPU the update of
``linear_policy_loss`` at 2,556 x 896 took the same time at 128, 256 and 512 MiB (within the runs' spread, about
16-19 s) while its memory rose with the chunk (``benchmarks/RESULTS.md``)."""


def default_chunk_bytes(device: torch.device) -> int:
    """The lm_head ops' chunk when the caller gives none: ``DEFAULT_CHUNK_BYTES`` on CUDA, else the CPU's."""
    return DEFAULT_CHUNK_BYTES if device.type == "cuda" else DEFAULT_CPU_CHUNK_BYTES


# torch.addmm(..., out_dtype=torch.float32) with 16-bit operands: CUDA only, from PyTorch 2.8
_MM_OUT_DTYPE = torch.__version__ >= "2.8"


def chunk_rows_for(n_rows: int, vocab: int, itemsize: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk of logits fits ``chunk_bytes``; a multiple of 128 rows once above 128 (the
    matmul's tile height on tensor cores, so no chunk but the last runs a ragged tile)."""
    rows = max(1, chunk_bytes // max(1, vocab * itemsize))
    if rows >= 128:
        rows -= rows % 128
    return min(rows, max(1, n_rows))


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the lm_head matmul runs in: autocast's when it is on for this device, else the input's."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def check_lm_head_inputs(hidden, weight, ids, temperature: float, chunk_bytes: int | None) -> int:
    """Check the inputs of an op over ``hidden @ weight.T``; returns the rows per chunk for ``chunk_bytes`` (None:
    the device's default, ``default_chunk_bytes``)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H) with one H; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    check_logprob_inputs(hidden, ids, temperature, name="hidden")
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    itemsize = torch.empty((), dtype=matmul_dtype(hidden)).element_size()
    return chunk_rows_for(hidden.shape[0], weight.shape[0], itemsize, chunk_bytes)


@dataclass(frozen=True)
class LmHeadPlan:
    """How an lm_head op runs: ``chunk_rows`` rows of logits at a time, each chunk through ``token_logprobs``'
    Triton kernels (``use_triton``) or its PyTorch path, at ``temperature``."""

    chunk_rows: int
    use_triton: bool
    temperature: float

    @property
    def logprobs_forward(self) -> Callable[..., None]:
        return launchers(self.use_triton)[0]

    @property
    def logprobs_backward(self) -> Callable[..., None]:
        return launchers(self.use_triton)[1]


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # the operands are already in the chosen dtype; autocast must not cast them again
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b, out=out)


def chunks(
    hidden: torch.Tensor, w: torch.Tensor, chunk_rows: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Each chunk's rows, its hidden states ``h`` (C, H) in ``w``'s dtype (the matmul's) and its logits ``h @ w.T``
    (C, V): matmul 1. The caller drops the logits (``del logits``) before it asks for the next chunk, so that one
    chunk of logits is alive at any time; the same ``w`` gives bit-identical logits in a recomputation."""
    N = hidden.shape[0]
    for start in range(0, N, chunk_rows):
        rows = slice(start, min(start + chunk_rows, N))
        h = hidden[rows].to(w.dtype)  # (C, H)
        yield rows, h, mm(h, w.T)  # (C, V)


class LmHeadGrads:
    """The gradients of ``hidden`` (N, H) and of ``weight`` (V, H), formed chunk by chunk from each chunk's
    dloss/dlogits: matmuls 2 and 3.

    The weight's gradient is a sum over the chunks. It accumulates in float32 (float64 for float64 weights) whatever
    the matmul dtype, as TRL 1.16's ``trl/kernels/chunked_logprob.py`` does (``torch.addmm(..., out_dtype=
    torch.float32)`` on CUDA), and is rounded to the weight's dtype once, after the last chunk: rounding each chunk's
    V x H product to bf16 before summing drifts training (that file's comment reports entropy falling over a few
    dozen steps). For float32 weights outside autocast the accumulator is the weight's own dtype, so the sum is the
    same ``addmm_`` it always was. The cost: a float32 (V, H) buffer for 16-bit weights.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, *, need_hidden: bool, need_weight: bool) -> None:
        self.hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        self._weight_dtype = weight.dtype

    def add(self, rows: slice, grad_logits: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """Add chunk ``rows``' share, from its dloss/dlogits (C, V) and the matmul's operands ``h`` (C, H), ``w``
        (V, H) of ``chunks``."""
        if self.hidden is not None and w.dtype == self.hidden.dtype:
            mm(grad_logits, w, out=self.hidden[rows])  # (C, H), matmul 2
        elif self.hidden is not None:
            self.hidden[rows] = mm(grad_logits, w)
        if self.weight is not None:
            _accumulate(self.weight, grad_logits.T, h)  # (V, H) += (V, C) @ (C, H), matmul 3

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(grad_hidden, grad_weight), each None when not asked for; the weight's in its own dtype."""
        grad_weight = self.weight
        if grad_weight is not None and grad_weight.dtype != self._weight_dtype:
            grad_weight = grad_weight.to(self._weight_dtype)  # 16-bit weights: rounded once, after the sum
        return self.hidden, grad_weight


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 (or float64) and ``a``, ``b`` in the matmul dtype: no rounding of the
    product to 16 bits, and no (V, H) temporary where the device can write the float32 sum directly."""
    with torch.autocast(a.device.type, enabled=False):
        if a.dtype == acc.dtype:
            acc.addmm_(a, b)
        elif _MM_OUT_DTYPE and acc.is_cuda and acc.dtype == torch.float32:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:  # 16-bit operands elsewhere (the CPU has no out_dtype): upcast the (C, .) operands, not the product
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
