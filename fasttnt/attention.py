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
* else (the CPU, or float32 inputs) SDPA over the same boundaries: the sequences gathered into right-padded
  batches of similar lengths, each attending causally to itself alone.

A row may hold a prompt once for its K responses (``fasttnt.policy``): each kernel still sees sequences of prompt +
response (``Packing.expand`` gathers them), so the sharing needs nothing of it.

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
    """Packed sequences of similar lengths as one right-padded batch of ``rows`` x ``length`` slots."""

    source: torch.Tensor  # (n,) int64: the row token that fills each occupied slot
    slot: torch.Tensor  # (n,) int64: that slot, as row * length + position
    rows: int
    length: int


@dataclass(frozen=True)
class Packing:
    """Where the sequences of one flattened row begin and end.

    A row may hold a prompt once for several of its sequences (the K responses of a prompt): the attention then
    runs over *virtual* sequences, prompt + response each, whose tokens ``expand`` gathers from the row, and each
    row token takes its output from the virtual token ``keep`` names. Every token's states are those of its
    sequence alone, as without sharing, while the prompt's projections and MLP run once."""

    cu_seqlens: torch.Tensor  # (S+1,) int32 on the model's device, over virtual tokens: FlashAttention takes int32
    bounds: tuple[int, ...]  # (S+1,) the same on the host, so no kernel needs a device sync to read them
    max_len: int
    expand: torch.Tensor | None = None  # (bounds[-1],) int64 on the device: the row token of each virtual token
    keep: torch.Tensor | None = None  # (tokens,) int64 on the device: the virtual token each row token reads
    _expand_host: torch.Tensor | None = None
    _keep_host: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        lengths: Sequence[int],
        device: torch.device | str,
        *,
        expand: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> Packing:
        """``lengths``: of the (virtual) sequences; ``expand`` and ``keep``: host int64 tensors where the row
        shares tokens between sequences (both or neither)."""
        bounds = (0, *itertools.accumulate(lengths))
        cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
        if (expand is None) != (keep is None):
            raise ValueError("a shared packing needs both expand and keep")
        if expand is not None and len(expand) != bounds[-1]:
            raise ValueError(f"expand has {len(expand)} entries for {bounds[-1]} virtual tokens")
        on_device = [None if t is None else t.to(device, non_blocking=True) for t in (expand, keep)]
        return cls(cu, bounds, max(lengths, default=0), *on_device, expand, keep)

    @property
    def tokens(self) -> int:
        """Tokens in the row (fewer than the virtual tokens where sequences share a prompt)."""
        return self.bounds[-1] if self._keep_host is None else len(self._keep_host)

    @functools.cached_property
    def padded_layout(self) -> tuple[list[PaddedChunk], torch.Tensor]:
        """The sequences as right-padded batches, for SDPA without FlashAttention: sorted by length and cut in up
        to ``_PADDED_CHUNKS`` chunks (padding a 20-token sequence to the longest 100 would cost attention for 100),
        each of at most ``_PADDED_SCORE_ELEMENTS`` score elements (a longer sequence is a chunk of its own). And
        ``order`` (tokens,): where each row token's output is in the chunks' outputs concatenated. Built on the
        host once per forward, used by every layer."""
        spans = [(a, b) for a, b in itertools.pairwise(self.bounds) if b > a]
        spans.sort(key=lambda span: span[1] - span[0])
        per_chunk = -(-len(spans) // _PADDED_CHUNKS)  # ceil
        chunks, done, start = [], 0, 0
        at = torch.empty(self.bounds[-1], dtype=torch.long)  # (virtual tokens,) position in the concatenated outputs
        while start < len(spans):
            end = start + 1  # sorted by length: the last sequence of a chunk is its longest
            while (
                end < len(spans)
                and end - start < per_chunk
                and (end - start + 1) * (spans[end][1] - spans[end][0]) ** 2 <= _PADDED_SCORE_ELEMENTS
            ):
                end += 1
            length = spans[end - 1][1] - spans[end - 1][0]
            virtual = torch.cat([torch.arange(a, b) for a, b in spans[start:end]])  # (n,)
            slot = torch.cat([row * length + torch.arange(b - a) for row, (a, b) in enumerate(spans[start:end])])
            source = virtual if self._expand_host is None else self._expand_host[virtual]
            chunks.append(PaddedChunk(source, slot, end - start, length))
            at[virtual] = torch.arange(done, done + len(virtual))
            done, start = done + len(virtual), end
        return chunks, at if self._keep_host is None else at[self._keep_host]


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


def packed_hidden_states(base, input_ids, position_ids, packing: Packing) -> torch.Tensor:
    """The last hidden states (1, T, H) of a transformers base model (``model.model``, routed through
    ``use_packed_attention``) over one packed row, input_ids and position_ids (1, T). No mask: the packing keeps the
    sequences apart. Where the model takes a per-layer-type mapping of masks, one of None builds none (transformers
    would otherwise scan position_ids for packed sequences, a device sync). use_cache=False: a forward with a cache
    is taken for generation."""
    masks = {"full_attention": None, "sliding_attention": None} if takes_mask_mapping(type(base)) else None
    with packed_forward():
        out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=masks, use_cache=False,
                   packing=packing)  # fmt: skip
    return out.last_hidden_state


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
    if query.shape[0] != 1 or query.shape[2] != packing.tokens:
        raise ValueError(
            f"packed attention takes one flattened row of {packing.tokens} tokens, got query {tuple(query.shape)}"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) each
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        # RoPE's float32 cos/sin promote autocast's bf16 projections back to float32; FlashAttention takes 16-bit
        # inputs, so cast them as transformers' own flash integration does (to autocast's dtype); the CPU's padded
        # SDPA gets the same inputs, so both paths attend in the precision autocast chose
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_attention(q, k, v, packing, scale=scaling, dropout=dropout)  # (T, Hq, D)
    return out.unsqueeze(0), None


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, *, scale: float | None, dropout: float = 0.0
) -> torch.Tensor:
    """Causal attention within each packed sequence: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D); GQA when
    Hkv < Hq. Where the row shares prompts, the varlen kernels run over the virtual sequences (their tokens
    gathered: the same kernel call as an unshared row of prompt + response each) and each row token reads back
    its own output; the padded path gathers straight from the row."""
    backend = varlen_backend(q)
    if backend == "sdpa_padded":
        return _sdpa_by_sequence(q, k, v, packing, scale=scale, dropout=dropout)
    if packing.expand is not None:
        q, k, v = (t.index_select(0, packing.expand) for t in (q, k, v))  # (virtual tokens, H, D)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_len, packing.max_len,
            dropout_p=dropout, softmax_scale=scale, causal=True,
        )  # fmt: skip
    else:
        if dropout:
            raise ValueError("PyTorch's varlen attention has no dropout; install flash-attn or set attention dropout 0")
        out = _torch_varlen(q, k, v, packing, scale)
    return out if packing.keep is None else out.index_select(0, packing.keep)


# the padded SDPA path: chunks of similar lengths (fewer padded keys to attend to, at a cost per SDPA call; 4 was
# the fastest for the embedded task's 256 sequences of 20-110 tokens on a 2-core CPU), and the (sequences, longest,
# longest) score elements one call may take: 256 sequences of 110 tokens are 3M; a chunk of long sequences stays far
# below a GiB
_PADDED_CHUNKS = 4
_PADDED_SCORE_ELEMENTS = 2**24


def _sdpa_by_sequence(q, k, v, packing: Packing, *, scale: float | None, dropout: float) -> torch.Tensor:
    """SDPA over the same boundaries, without FlashAttention (the CPU, float32): the sequences gathered into
    right-padded batches, each sequence attending causally to itself alone. Right padding needs no mask: a causal
    query never reaches the padded keys after its sequence, and the padded queries' outputs are dropped (zero
    gradient), so the kernel may skip the masked half."""
    chunks, order = packing.padded_layout
    outs = []
    for chunk in chunks:
        qp, kp, vp = (_padded(t, chunk) for t in (q, k, v))  # (rows, H, length, D) each
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, dropout_p=dropout,
                                             enable_gqa=True)  # fmt: skip
        out = out.transpose(1, 2).reshape(chunk.rows * chunk.length, *q.shape[1:])  # (slots, Hq, D)
        outs.append(out.index_select(0, chunk.slot.to(q.device)))  # (chunk's tokens, Hq, D)
    return torch.cat(outs).index_select(0, order.to(q.device))  # (T, Hq, D) in row order


def _padded(t: torch.Tensor, chunk: PaddedChunk) -> torch.Tensor:
    """(T, H, D) row tokens -> (rows, H, length, D), zeros where padded. A copy into distinct slots, so the
    backward is a gather (indexing with repeated pad indices would scatter-add instead)."""
    flat = t.new_zeros(chunk.rows * chunk.length, *t.shape[1:])
    flat = flat.index_copy(0, chunk.slot.to(t.device), t.index_select(0, chunk.source.to(t.device)))
    return flat.view(chunk.rows, chunk.length, *t.shape[1:]).transpose(1, 2)


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


def varlen_options(params, *, scale: float | None, head_dim: int, gqa: bool) -> dict:
    """The keyword arguments for this PyTorch's ``varlen_attn`` (``params``: its signature's parameter names), which
    have changed across releases: causality is ``is_causal=True`` in 2.9-2.10 and a (left, right) window later, (-1, 0)
    being causal; ``enable_gqa`` and ``scale`` exist in some releases only. Without ``scale`` the kernel uses
    1/sqrt(head_dim): a model with another scale is refused rather than attended with the wrong one."""
    options: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if gqa and "enable_gqa" in params:
        options["enable_gqa"] = True
    if "scale" in params:
        options["scale"] = scale
    elif scale is not None and abs(scale * head_dim**0.5 - 1) > 1e-6:
        raise ValueError(
            f"this PyTorch's varlen_attn ({torch.__version__}) takes no scale, and the model's attention scale {scale} "
            f"is not 1/sqrt(head_dim={head_dim}): install flash-attn, or a PyTorch whose varlen_attn takes scale"
        )
    return options


def _torch_varlen(q, k, v, packing: Packing, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    options = varlen_options(inspect.signature(varlen_attn).parameters, scale=scale, head_dim=q.shape[-1],
                             gqa=k.shape[1] != q.shape[1])  # fmt: skip
    if k.shape[1] != q.shape[1] and "enable_gqa" not in options:
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
