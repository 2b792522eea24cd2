"""One decode step of a Qwen2 or Llama model, written out: the hf engine's step without transformers' per-call work.

A decode step feeds one token per row. At the embedded default's shape (3 layers, hidden 128, 256 rows) the
arithmetic of a step is a few milliseconds and transformers' forward adds as much again around it: building the
attention mask from the padding mask, the cache's update protocol, the attention interface's dispatch (and
``repeat_kv``'s copy of every key and value for grouped-query attention), the decoder layers' keyword plumbing and
output records. This module computes the same function directly: the model's own modules and weights, the keys and
values appended to the same ``DynamicCache`` the prefill filled, attention over the unpadded keys through one
additive bias, grouped-query attention without copying keys. transformers' forward stays the prefill's and every
other model's; ``tests/test_hf_engine.py`` checks both against transformers ``generate`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


def supports(model) -> bool:
    """Whether ``step`` computes ``model``'s own forward: a Qwen2 or Llama causal LM whose layers are all full
    attention with SiLU MLPs and plain ``nn.Linear`` projections (a LoRA-wrapped or quantised projection is not,
    and takes transformers' forward)."""
    if type(model).__name__ not in _ARCHITECTURES or type(model.lm_head) is not nn.Linear:
        return False
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if cfg.hidden_act != "silu" or any(t != "full_attention" for t in layer_types):
        return False
    norms = [model.model.norm] + [
        n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if any(not hasattr(n, "variance_epsilon") for n in norms):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not nn.Linear for m in linears):
            return False
    return True


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Qwen2RMSNorm's and LlamaRMSNorm's forward (transformers 5.25), op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers' ``apply_rotary_pos_emb`` applies it (x: (B, heads, D); cos, sin:
    (B, 1, D))."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _joined(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases) of linears of one input stacked on the output dimension: one matmul for all."""
    weight = torch.cat([m.weight for m in linears])
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(len(m.weight)) for m in linears])


@dataclass
class _Layer:
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (heads + 2 kv heads) x D rows
    gate_up: tuple[torch.Tensor, torch.Tensor | None]  # 2 x intermediate rows


@dataclass
class Weights:
    """Each layer's query, key and value projections as one matrix, and its MLP's gate and up projections as one:
    copies, made once per rollout (the model's weights change with every update), that make a layer's seven
    products four."""

    layers: list[_Layer]

    @classmethod
    def of(cls, model) -> Weights:
        return cls([
            _Layer(
                qkv=_joined(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                gate_up=_joined(layer.mlp.gate_proj, layer.mlp.up_proj),
            )
            for layer in model.model.layers
        ])  # fmt: skip


def reserve(cache: DynamicCache, steps: int) -> None:
    """Give every layer of ``cache`` room for ``steps`` more positions (one copy of the prefill's keys and values),
    which ``step`` writes in place: appending by concatenation copied the whole cache at every step. From here on
    the cache is ``step``'s: its length is the decode mask's, not the buffers'."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            filled = getattr(layer, name)  # (B, kv heads, W, D)
            rows, heads, width, dim = filled.shape
            buffer = filled.new_empty((rows, heads, width + steps, dim))  # past the mask's length: never read
            buffer[:, :, :width] = filled
            setattr(layer, name, buffer)


@torch.no_grad()
def step(model, weights: Weights, cache: DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
         mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The next-token logits (B, V) of ``model`` (its ``weights`` joined by ``Weights.of``) fed ``tokens`` (B,) at
    ``positions`` (B,), attending to the cached keys and values where ``mask`` (B, L + 1, the new token's column
    included) is 1; the new keys and values are written at position L of ``cache`` (made room in by ``reserve``)."""
    body, cfg = model.model, model.config
    rows, length = mask.shape  # L + 1
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    x = body.embed_tokens(tokens[:, None])[:, 0]  # (B, H): the module call, so that its hooks see a (B, 1) input
    cos, sin = body.rotary_emb(x, positions[:, None])  # (B, 1, D) each: the model's own rotary (its scaling too)
    # additive: 0 on the keys a row attends to, -inf on its prompt's left padding (never all of a row)
    bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(mask == 0, -float("inf"))
    bias = bias[:, None, None, :]  # (B, 1, 1, L + 1)
    for layer, joined, cached in zip(body.layers, weights.layers, cache.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        dim = attn.head_dim
        qkv = F.linear(_rms_norm(x, layer.input_layernorm), *joined.qkv).view(rows, heads + 2 * kv_heads, dim)
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)  # the queries and keys rotated at once
        cached.keys[:, :, length - 1] = qk[:, heads:]  # (B, kv heads, D) into (B, kv heads, L + 1 + room, D)
        cached.values[:, :, length - 1] = qkv[:, heads + kv_heads :]
        keys, values = cached.keys[:, :, :length], cached.values[:, :, :length]  # (B, kv heads, L + 1, D)
        # each kv head's group of query heads attends to its keys: (B, kv heads, group, L + 1)
        q = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling + bias
        probs = torch.softmax(scores, -1).to(values.dtype)  # float32 under bf16 autocast
        out = torch.matmul(probs, values).reshape(rows, heads * dim)  # (B, heads x D)
        x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), *joined.gate_up).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    return model.lm_head(_rms_norm(x, body.norm))  # (B, V): the module call, so that its hooks apply
