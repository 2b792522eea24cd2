"""The policy's log-probabilities of sampled responses, from one padding-free packed forward.

Prompt + response sequences are packed back to back into rows of at most ``pack_tokens`` tokens, with position
ids restarting at 0 for each sequence and no attention mask: transformers then keeps attention inside each
sequence (FlashAttention's varlen kernel on CUDA when ``attn_implementation="flash_attention_2"``, a
block-diagonal mask through SDPA elsewhere). The last hidden states of the response positions go to
``linear_token_logprobs`` with the lm_head weight, so the logits are never materialised.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from fasttnt_kernels import linear_token_logprobs

from .rollout import RolloutBatch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) sequences back to back, pad at each row's end
    position_ids: torch.Tensor  # (R, L) restarting at 0 for every sequence (and for the padding)
    hidden_index: torch.Tensor  # (N,) flat index into (R*L) of the state that predicts each response token


def pack_rows(prompts: list[list[int]], responses: list[list[int]], pack_tokens: int, pad_id: int) -> PackedRows:
    """First-fit in order: each sequence goes to the current row while it fits, else starts a new one."""
    rows: list[list[int]] = [[]]
    placed: list[tuple[int, int]] = []  # (row, offset) of each sequence
    for prompt, response in zip(prompts, responses, strict=True):
        n = len(prompt) + len(response)
        if rows[-1] and len(rows[-1]) + n > pack_tokens:
            rows.append([])
        placed.append((len(rows) - 1, len(rows[-1])))
        rows[-1].extend(prompt + response)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    starts: list[list[int]] = [[] for _ in rows]
    for row, offset in placed:
        starts[row].append(offset)
    for r, tokens in enumerate(rows):
        input_ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        bounds = [*starts[r], len(tokens)]
        for a, b in itertools.pairwise(bounds):
            position_ids[r, a:b] = torch.arange(b - a)
        position_ids[r, len(tokens) :] = torch.arange(width - len(tokens))  # padding: a sequence of its own
    index = []
    for (row, offset), prompt, response in zip(placed, prompts, responses, strict=True):
        first = row * width + offset + len(prompt) - 1  # the state after the last prompt token predicts token 0
        index.extend(range(first, first + len(response)))
    return PackedRows(input_ids, position_ids, torch.tensor(index, dtype=torch.long))


class PolicyHead(torch.nn.Module):
    """The policy as the update uses it: packed rows in, response-token log-probs out, in one module forward (so
    that under ZeRO-3 the lm_head weight is gathered for the fused op, as an external parameter of this module)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, hidden_index, targets, temperature: float, with_entropy: bool):
        # use_cache=False matters: with a KV cache transformers assumes generation and ignores the packing (it only
        # builds the per-sequence mask from position_ids when there is neither an attention mask nor a cache)
        out = self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state  # (R, L, H)
        hidden = hidden.reshape(-1, hidden.shape[-1])[hidden_index]  # (N, H)
        weight = self.model.get_output_embeddings().weight  # (V, H)
        hidden = hidden.to(weight.dtype)  # under autocast the states are 16-bit; the op casts per autocast itself
        result = linear_token_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=with_entropy)
        return result if with_entropy else (result, None)


def response_logprobs(
    model,
    batch: RolloutBatch,
    *,
    temperature: float,
    pack_tokens: int,
    pad_id: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of the batch's response tokens under ``model`` (a causal LM, or its ``PolicyHead``) at the
    sampling temperature, and the per-token entropy when asked; differentiable when grad is enabled."""
    # a PolicyHead, DeepSpeed's engine around one (it has .module), or a bare causal LM
    head = model if isinstance(model, PolicyHead) or hasattr(model, "module") else PolicyHead(model)
    device = batch.response_ids.device
    rows = pack_rows(batch.prompt_ids, batch.responses, pack_tokens, pad_id)
    return head(
        rows.input_ids.to(device),
        rows.position_ids.to(device),
        rows.hidden_index.to(device),
        batch.response_ids,
        temperature,
        with_entropy,
    )
