"""One decode step of a Qwen2 or Llama model, written out: the hf engine's step without transformers' per-call work.

A decode step feeds one token per row. At the embedded default's shape (3 layers, hidden 128, 256 rows) the
arithmetic of a step is a few milliseconds and transformers' forward adds as much again around it: building the
attention mask from the padding mask, the cache's update protocol, the attention interface's dispatch (and
``repeat_kv``'s copy of every key and value for grouped-query attention), the decoder layers' keyword plumbing and
output records. This module computes the same function directly: the model's own modules and weights, the keys and
values written in place into the layers of the ``DynamicCache`` the prefill filled (grown by half when full),
attention over the unpadded keys through one additive bias, grouped-query attention without copying keys.
transformers' forward stays the prefill's and every other model's; ``tests/test_hf_engine.py`` checks both against
transformers ``generate`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache


def supports(model) -> bool:
    """Whether ``step`` computes ``model``'s own forward: transformers' Qwen2 or Llama causal LM (those classes, not a
    remote-code class of the same name) whose layers are all full attention with SiLU MLPs and plain ``nn.Linear``
    projections (a LoRA-wrapped or quantised projection is not), with no hook inside a layer (a steering hook,
    accelerate's offload: the step would pass them by; the embedding's and lm_head's run, called as modules) and
    weights in memory. Any other model decodes through transformers' forward. Asked at every rollout, so that a
    projection wrapped after the engine was built is seen."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    if type(model) not in (Qwen2ForCausalLM, LlamaForCausalLM) or type(model.lm_head) is not nn.Linear:
        return False
    cfg, layers = model.config, model.model.layers
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if cfg.hidden_act != "silu" or any(t != "full_attention" for t in layer_types):
        return False
    if len(layers) != cfg.num_hidden_layers:  # transformers runs the first num_hidden_layers
        return False
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not nn.Linear or m.weight.is_meta for m in linears):
            return False
        for module in layer.modules():
            if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
                return False
    norms = [
        model.model.norm,
        *(n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)),
    ]
    return all(hasattr(n, "variance_epsilon") for n in norms)


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
    """The weights (and biases) of linears of one input stacked on the output dimension: one matmul for all. Under
    autocast in its dtype: autocast keeps its cast of a parameter for the whole region, but not of a tensor made from
    parameters, which it would cast again at every step."""
    weight = linears[0].weight
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    joined = torch.cat([m.weight.to(dtype) for m in linears])
    if all(m.bias is None for m in linears):
        return joined, None
    biases = [m.bias if m.bias is not None else m.weight.new_zeros(len(m.weight)) for m in linears]
    return joined, torch.cat([b.to(dtype) for b in biases])


@dataclass
class _Layer:
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (heads + 2 kv heads) x D rows
    gate_up: tuple[torch.Tensor, torch.Tensor | None]  # 2 x intermediate rows


@dataclass
class Weights:
    """Each layer's query, key and value projections as one matrix, and its MLP's gate and up projections as one:
    copies (in the autocast dtype under autocast), made once per rollout (the model's weights change with every
    update), that make a layer's seven products four. Made inside the engine's autocast region."""

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


def _room_for(layer, length: int) -> None:
    """Make room in a cache layer's keys and values for ``length`` positions, growing by half of what it holds (at
    least 16 positions) when full: amortised, a growth copies each position a bounded number of times, where
    appending by concatenation copied the whole cache at every step; and, unlike room for the whole budget made
    up front, a rollout whose responses end early never holds more than half again what it uses."""
    filled = layer.keys.shape[2]
    if filled >= length:
        return
    size = max(length, filled + max(16, filled // 2))
    for name in ("keys", "values"):
        old = getattr(layer, name)  # (B, kv heads, filled, D)
        buffer = old.new_empty((*old.shape[:2], size, old.shape[3]))  # past the mask's length: never read
        buffer[:, :, :filled] = old
        setattr(layer, name, buffer)


@torch.no_grad()
def step(model, weights: Weights, cache: DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
         mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The next-token logits (B, V) of ``model`` (its ``weights`` joined by ``Weights.of``) fed ``tokens`` (B,) at
    ``positions`` (B,), attending to the cached keys and values where ``mask`` (B, L + 1, the new token's column
    included) is 1; the new keys and values are written at position L of ``cache``, whose layers' buffers grow as
    needed (``_room_for``) and hold unwritten positions past L + 1: from the first step on, the cache is ``step``'s,
    its length the mask's."""
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
        _room_for(cached, length)
        cached.keys[:, :, length - 1] = qk[:, heads:]  # (B, kv heads, D) into (B, kv heads, L + 1 + room, D)
        cached.values[:, :, length - 1] = qkv[:, heads + kv_heads :]
        keys, values = cached.keys[:, :, :length], cached.values[:, :, :length]  # (B, kv heads, L + 1, D)
        # each kv head's group of query heads attends to its keys: (B, kv heads, group, L + 1)
        q = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling + bias
        # in float32 at least (autocast's softmax is float32; a bf16 model's scores are not)
        probs = torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
        out = torch.matmul(probs, values).reshape(rows, heads * dim)  # (B, heads x D)
        x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), *joined.gate_up).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    return model.lm_head(_rms_norm(x, body.norm))  # (B, V): the module call, so that its hooks apply
