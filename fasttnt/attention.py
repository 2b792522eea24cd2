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
* else (the CPU, or float32 inputs) SDPA once per sequence over the same boundaries.

A forward without ``packing`` (generation: a left-padded batch with a KV cache) runs the implementation the model
had before, with its own masks, so one model serves the rollout engine and the update.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_PREFIX = "fasttnt_packed:"


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


def use_packed_attention(model) -> str:
    """Route ``model``'s attention through ``packed_attention`` whenever a forward carries ``packing=``; every other
    forward keeps the implementation the model was loaded with. Returns the implementation's registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    current = model.config._attn_implementation
    if current.startswith(_PREFIX):
        return current
    name = _PREFIX + current
    # one name per fallback implementation, registered once per process (no state kept on the model or its config,
    # which save_pretrained would write)
    AttentionInterface.register(name, functools.partial(packed_attention, fallback=current))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(current, sdpa_mask))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} does not take a registered attention function ({name})")
    return name


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
        return _fallback(module, fallback)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    if sliding_window is not None:
        raise ValueError(f"packed attention has no sliding window (layer {getattr(module, 'layer_idx', '?')})")
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
    # SDPA once per sequence: the same boundaries, no (T, T) mask
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (H, T, D)
    outs = [
        F.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=True
        )
        for a, b in itertools.pairwise(packing.bounds)
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)  # (T, Hq, D)


def varlen_backend(q: torch.Tensor) -> str:
    """``flash_attn``, ``torch_varlen`` or ``sdpa_per_sequence``: which kernel the packed attention of ``q`` runs."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "sdpa_per_sequence"  # the CPU; and FlashAttention rejects float32
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    if _torch_varlen_available():
        _activate_fa3(q.device)
        return "torch_varlen"
    return "sdpa_per_sequence"


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
