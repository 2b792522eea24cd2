"""Packed attention owned by fasttnt: sequences back to back in one flattened row, kept apart by boundaries that
the packer computes on the host.

Left to itself, transformers keeps packed sequences apart only in narrow cases: under
``attn_implementation="flash_attention_2"`` a batch of more than one row is taken as *not* packed, so every
sequence attends to the ones packed before it in its row; with one row the boundaries are recovered from
``position_ids`` with a device sync in every layer (``find_packed_sequence_indices``, transformers 5.24). Here the
training forwards pass the boundaries themselves (``packing=Packing(...)``) to an attention function registered
with transformers' ``AttentionInterface``, which runs, by what the machine has:

* ``flash-attn``: ``flash_attn_varlen_func`` (CUDA, 16-bit inputs);
* else PyTorch's own FlashAttention, ``torch.nn.attention.varlen.varlen_attn`` (CUDA, 16-bit inputs), with
  FlashAttention-3 activated on Hopper where PyTorch offers it;
* else (the CPU, or float32 inputs) SDPA over the same boundaries: the sequences gathered into padded batches,
  each attending causally to itself alone.

A forward without ``packing`` (generation: a left-padded batch with a KV cache) runs the implementation the model
had before, with its own masks, so one model serves the rollout engine and the update.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_PREFIX = "fasttnt_packed:"
# true while a packed forward runs: its masks are not built, and an attention call without the packing is an error
_IN_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("fasttnt_packed_forward", default=False)


@dataclass(frozen=True)
class PaddedChunk:
    """Consecutive packed sequences as a padded batch: the packed index of each (sequence, position)."""

    index: torch.Tensor  # (s, L) int64 token index into the row; 0 where padded
    valid: torch.Tensor  # (s, L) bool


@dataclass(frozen=True)
class Packing:
    """Where the sequences of one flattened row begin and end."""

    cu_seqlens: torch.Tensor  # (S+1,) int32 on the model's device: FlashAttention's kernels take int32
    bounds: tuple[int, ...]  # (S+1,) the same on the host, so no kernel needs a device sync to read them
    max_len: int

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str) -> Packing:
        bounds = (0, *itertools.accumulate(lengths))
        cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
        return cls(cu, bounds, max(lengths, default=0))

    @functools.cached_property
    def padded_chunks(self) -> list[PaddedChunk]:
        """The sequences in order, in padded batches of at most ``_PADDED_MASK_ELEMENTS`` mask elements (a
        sequence longer than that is a chunk of its own). Built on the host once per forward, used by every layer."""
        spans = list(itertools.pairwise(self.bounds))
        chunks, start = [], 0
        while start < len(spans):
            end, longest = start, 0
            while end < len(spans):
                longest_next = max(longest, spans[end][1] - spans[end][0])
                if end > start and (end - start + 1) * longest_next**2 > _PADDED_MASK_ELEMENTS:
                    break
                longest, end = longest_next, end + 1
            positions = torch.arange(max(longest, 1))
            firsts = torch.tensor([a for a, _ in spans[start:end]])[:, None]  # (s, 1)
            lengths = torch.tensor([b - a for a, b in spans[start:end]])[:, None]
            valid = positions[None, :] < lengths  # (s, L)
            chunks.append(PaddedChunk(torch.where(valid, firsts + positions[None, :], 0), valid))
            start = end
        return chunks


def use_packed_attention(model) -> str:
    """Route ``model``'s attention through ``packed_attention`` whenever a forward carries ``packing=``; every other
    forward (generation) keeps the implementation the model was loaded with, except FlashAttention's, which becomes
    SDPA: transformers recognises a flash implementation by "flash" in its name and would look a name like ours up
    as a hub kernel. Returns the implementation's registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    current = model.config._attn_implementation
    if current.startswith(_PREFIX):
        return current
    fallback = "sdpa" if "flash" in current else current
    name = _PREFIX + fallback
    # one name per fallback implementation, registered once per process (no state kept on the model or its config,
    # which save_pretrained would write)
    fallback_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(fallback, sdpa_mask)
    AttentionInterface.register(name, functools.partial(packed_attention, fallback=fallback))
    AttentionMaskInterface.register(name, functools.partial(_packed_mask, fallback_mask=fallback_mask))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} does not take a registered attention function ({name})")
    return name


@contextlib.contextmanager
def packed_forward():
    """For the duration of a packed forward: no attention masks are built (the packing keeps the sequences apart),
    and an attention call that did not receive the packing raises instead of attending across sequences."""
    token = _IN_PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_PACKED_FORWARD.reset(token)


def _packed_mask(*args, fallback_mask, **kwargs):
    return None if _IN_PACKED_FORWARD.get() else fallback_mask(*args, **kwargs)


_MASK_MAPPING = re.compile(r"isinstance\(\s*(?:\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")


@functools.cache
def takes_mask_mapping(model_class: type) -> bool:
    """Whether a transformers base model's forward takes ``attention_mask`` as a mapping of ready masks per layer
    type (Qwen2, Qwen3, ... in transformers 5): given ``{..: None}`` it builds none, which skips scanning
    ``position_ids`` for packed sequences (a device sync). Others (Llama, Mistral, ...) get ``None`` and scan once
    per forward; their mask is still None (``_packed_mask``)."""
    try:
        return bool(_MASK_MAPPING.search(inspect.getsource(model_class.forward)))
    except (OSError, TypeError):
        return False


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    fallback: str,
    packing: Packing | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: query (1, Hq, T, D), key/value (1, Hkv, T, D) in, (1, T, Hq, D) out."""
    if packing is None:
        if _IN_PACKED_FORWARD.get():
            raise RuntimeError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was called without the packing: "
                "this model's layers do not pass keyword arguments on to attention, so packed sequences cannot be "
                "kept apart in it"
            )
        return _fallback(module, fallback)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    unsupported = [k for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None]
    if sliding_window is not None or unsupported:
        what = "a sliding window" if sliding_window is not None else ", ".join(unsupported)
        raise ValueError(f"packed attention has no {what} (layer {getattr(module, 'layer_idx', '?')})")
    if query.shape[0] != 1 or query.shape[2] != packing.bounds[-1]:
        raise ValueError(
            f"packed attention takes one flattened row of {packing.bounds[-1]} tokens, got query {tuple(query.shape)}"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) each
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # RoPE's float32 cos/sin promote autocast's bf16 projections back to float32; FlashAttention takes 16-bit
        # inputs, so cast them as transformers' own flash integration does (to autocast's dtype)
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_attention(q, k, v, packing, scale=scaling, dropout=dropout)  # (T, Hq, D)
    return out.unsqueeze(0), None


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, *, scale: float | None, dropout: float = 0.0
) -> torch.Tensor:
    """Causal attention within each packed sequence: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D); GQA when
    Hkv < Hq."""
    backend = varlen_backend(q)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_len, packing.max_len,
            dropout_p=dropout, softmax_scale=scale, causal=True,
        )  # fmt: skip
    if backend == "torch_varlen":
        if dropout:
            raise ValueError("PyTorch's varlen attention has no dropout; install flash-attn or set attention dropout 0")
        return _torch_varlen(q, k, v, packing, scale)
    return _sdpa_by_sequence(q, k, v, packing, scale=scale, dropout=dropout)


# elements of the (sequences, longest, longest) mask one padded SDPA call may take: 256 sequences of 110 tokens
# (the embedded task's step) is 3M; a chunk of long sequences stays far below a GiB
_PADDED_MASK_ELEMENTS = 2**24


def _sdpa_by_sequence(q, k, v, packing: Packing, *, scale: float | None, dropout: float) -> torch.Tensor:
    """SDPA over the same boundaries, without FlashAttention (the CPU, float32): the sequences gathered into a
    padded batch, in chunks whose mask stays small, each sequence attending causally to itself alone."""
    outs = []
    for chunk in packing.padded_chunks:
        index, valid = chunk.index.to(q.device), chunk.valid.to(q.device)  # (s, L) each
        qp, kp, vp = (t[index].transpose(1, 2) for t in (q, k, v))  # (s, H, L, D): padding reads token 0
        length = index.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        # (s, 1, L, L): a sequence's own keys, causally; the diagonal too, so that no row is fully masked (a padded
        # query of an empty sequence would be NaN, and NaN times a zero gradient is NaN)
        mask = (causal & valid[:, None, None, :]) | torch.eye(length, dtype=torch.bool, device=q.device)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, dropout_p=dropout,
                                             enable_gqa=True)  # fmt: skip
        outs.append(out.transpose(1, 2)[valid])  # (tokens of the chunk, Hq, D), in packed order
    return torch.cat(outs)  # (T, Hq, D)


def varlen_backend(q: torch.Tensor) -> str:
    """``flash_attn``, ``torch_varlen`` or ``sdpa_padded``: which kernel the packed attention of ``q`` runs."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "sdpa_padded"  # the CPU; and FlashAttention rejects float32
    if _flash_attn_available():
        return "flash_attn"
    if _torch_varlen_available():
        _activate_fa3(q.device)
        return "torch_varlen"
    return "sdpa_padded"


@functools.cache
def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _torch_varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (PyTorch >= 2.9)
    except ImportError:
        return False
    return True


@functools.cache
def _activate_fa3(device: torch.device) -> str | None:
    """FlashAttention-3 for PyTorch's flash kernels on Hopper (sm_90), where this PyTorch has it registered;
    otherwise its built-in FlashAttention-2 stays. Once per process, on the first packed forward on the GPU."""
    import torch.nn.attention as attn

    if torch.cuda.get_device_capability(device)[0] != 9 or not hasattr(attn, "activate_flash_attention_impl"):
        return None
    if "FA3" not in attn.list_flash_attention_impls():
        return None
    try:
        attn.activate_flash_attention_impl("FA3")
    except (RuntimeError, ImportError, ValueError):  # registered, but its provider is not installed
        return None
    return "FA3"


def _torch_varlen(q, k, v, packing: Packing, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options: dict = {"scale": scale}
    # PyTorch 2.9-2.10 spell causality is_causal=True; later releases a (left, right) window, (-1, 0) being causal
    if "is_causal" in params:
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = packing.cu_seqlens
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (T, H, D) from a transposed view
    return varlen_attn(q, k, v, cu, cu, packing.max_len, packing.max_len, **options)


def _fallback(module: torch.nn.Module, name: str):
    """The model's own implementation, for forwards that are not packed (generation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # not in the interface: each modeling file defines its own, beside its attention class
        eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward to fall back to; use sdpa")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]
