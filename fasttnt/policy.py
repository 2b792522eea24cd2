"""The policy's log-probabilities of sampled responses, from padding-free packed forwards in micro-batches.

Prompt + response sequences are laid back to back in one flattened row per micro-batch, at most
``micro_batch_tokens`` tokens each (a longer sequence gets a micro-batch of its own), with position ids restarting
at 0 for each sequence. Consecutive sequences of the same prompt (a group's K responses) share one copy of it: the
prompt's tokens go through the model once, not K times (on the embedded task a quarter of the tokens), and each
response attends to it as if it were its own. The boundaries go to the model's attention as a ``Packing`` computed
here on the host (``fasttnt.attention``): sequences never attend to each other, whatever attention kernel runs.
The last hidden states of the response positions go to ``linear_token_logprobs`` (log-probs) or
``linear_policy_loss`` (the update's loss, its gradient formed in the same pass) with the lm_head weight, so the
logits are never materialised.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from fasttnt_kernels import PolicyLossConfig, PolicyLossInputs, linear_policy_loss, linear_token_logprobs

from . import distributed
from .attention import Packing, packed_hidden_states, use_packed_attention
from .engines.batch import RolloutBatch


@dataclass
class MicroBatch:
    """Sequences ``first .. last - 1`` of a batch, packed into one row (host tensors). Where consecutive sequences
    share their prompt, the row holds it once: ``expand`` and ``keep`` map between the row's tokens and the
    virtual sequences (prompt + response each) the attention runs over (``Packing``); both None when nothing is
    shared."""

    first: int
    last: int
    input_ids: torch.Tensor  # (1, T) each distinct prompt once, then its responses, back to back
    position_ids: torch.Tensor  # (1, T) a response's positions continue its prompt's
    hidden_index: torch.Tensor  # (n,) index into the T states of the one predicting each response token
    lengths: tuple[int, ...]  # (last - first,) prompt + response tokens of each sequence
    expand: torch.Tensor | None = None  # (sum(lengths),) the row token of each virtual token
    keep: torch.Tensor | None = None  # (T,) the virtual token whose output each row token takes

    @property
    def tokens(self) -> int:
        """Prompt + response tokens of its sequences, as the budget counts them (shared prompts each time)."""
        return sum(self.lengths)


def plan_micro_batches(batch: RolloutBatch, budget: int) -> list[MicroBatch]:
    """The batch's sequences in order, each micro-batch filled while the next sequence fits in ``budget`` tokens
    (prompt and response); a sequence longer than the budget gets a micro-batch of its own."""
    prompts, responses = batch.prompt_ids, batch.responses
    groups: list[list[int]] = []  # sequence indices of each micro-batch
    used = 0
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        n = len(prompt) + len(response)
        if not groups or used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [pack_micro_batch([prompts[i] for i in g], [responses[i] for i in g], g[0]) for g in groups]


def pack_micro_batch(prompts: list[list[int]], responses: list[list[int]], first: int) -> MicroBatch:
    """Sequences ``first ..`` of a batch (their prompts and responses) as one packed row, each distinct prompt once
    where consecutive sequences share it."""
    ids: list[int] = []
    positions: list[int] = []
    index: list[int] = []
    lengths: list[int] = []
    expand: list[int] = []  # virtual token -> row token
    keep: list[int] = []  # row token -> virtual token
    previous, prompt_at = None, 0
    for prompt, response in zip(prompts, responses, strict=True):
        p, r, virtual = len(prompt), len(response), len(expand)
        if prompt != previous:  # a new prompt: into the row; its tokens read the outputs of this first copy
            prompt_at = len(ids)
            ids.extend(prompt)
            positions.extend(range(p))
            keep.extend(range(virtual, virtual + p))
        response_at = len(ids)
        expand.extend(range(prompt_at, prompt_at + p))
        expand.extend(range(response_at, response_at + r))
        keep.extend(range(virtual + p, virtual + p + r))
        # the state after the last prompt token predicts response token 0, each response token the next
        index.extend([prompt_at + p - 1, *range(response_at, response_at + r - 1)][:r])
        ids.extend(response)
        positions.extend(range(p, p + r))
        lengths.append(p + r)
        previous = prompt
    shared = len(ids) < len(expand)
    return MicroBatch(
        first,
        first + len(prompts),
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([positions], dtype=torch.long),
        torch.tensor(index, dtype=torch.long),
        tuple(lengths),
        torch.tensor(expand, dtype=torch.long) if shared else None,
        torch.tensor(keep, dtype=torch.long) if shared else None,
    )


@dataclass(frozen=True)
class MicroBatchLossInputs(PolicyLossInputs):
    """``linear_policy_loss``'s inputs for one micro-batch: its slices of the per-sequence and per-token tensors and
    the normalisers of its whole mini-batch (over all ranks), which are the kernel's own ``PolicyLossInputs``, and
    the run's settings."""

    settings: PolicyLossConfig = field(default_factory=PolicyLossConfig)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
        """(loss, stats, logp) of the micro-batch's response tokens, the gradient formed in the same pass."""
        return linear_policy_loss(
            hidden, weight, targets, self, config=self.settings, temperature=temperature, return_logp=True
        )


class PolicyHead(torch.nn.Module):
    """The policy as the update uses it: a packed micro-batch in, response-token log-probs (or, given the loss's
    inputs, the policy loss) out, in one module forward (so that under ZeRO-3 the lm_head weight is gathered for
    the fused op, as an external parameter)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.attention = use_packed_attention(model)  # without it, `packing` would be ignored: sequences would mix

    def forward(
        self, input_ids, position_ids, packing: Packing, hidden_index, targets, temperature, with_entropy, loss=None
    ):
        if self.model.config._attn_implementation != self.attention:
            raise RuntimeError(f"the model's attention was changed to {self.model.config._attn_implementation!r}")
        states = packed_hidden_states(self.model.model, input_ids, position_ids, packing)  # (1, T, H)
        # index_select, not hidden[index]: a shared prompt's last position predicts the first token of each of its K
        # responses, so the index repeats, and advanced indexing's backward (index_put_ with accumulate) adds the
        # repeats with atomics on the CPU, in an order that differs from run to run at 2 threads (measured: 1-6e-6
        # apart at 2000-16000 rows of width 128); index_select's backward (index_add_) adds them in index order
        hidden = states[0].index_select(0, hidden_index)  # (n, H)
        weight = self.model.get_output_embeddings().weight  # (V, H)
        hidden = hidden.to(weight.dtype)  # under autocast the states are 16-bit; the op casts per autocast itself
        if loss is not None:  # a MicroBatchLossInputs: (loss, stats, logp)
            return loss(hidden, weight, targets, temperature)
        result = linear_token_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=with_entropy)
        return result if with_entropy else (result, None)


class _RowsIntoGrad(torch.autograd.Function):
    """A tied embedding's lookup whose backward adds its gradient rows into ``weight.grad`` in place (index_add_).

    forward(ids, embedding, anchor) looks the rows up. The weight is reached through the module, not passed as a
    tensor, and ``anchor`` (a leaf that requires grad) puts the lookup in the backward graph: there is no edge to
    the weight, so its AccumulateGrad does not wait for the lookup's backward. The lm_head side's gradient becomes
    (or, from a second micro-batch on, is added into) ``weight.grad`` as it comes, and the rows are added into it
    when they come; in the other order the sum is the same. Only for ``loss.backward()`` without ``inputs``: the
    rows never reach ``torch.autograd.grad``'s results, and a graph of the gradient (``create_graph``) is refused."""

    @staticmethod
    def forward(ctx, ids, embedding, anchor):
        ctx.save_for_backward(ids)
        ctx.embedding = embedding
        return torch.nn.functional.embedding(ids, embedding.weight, embedding.padding_idx)  # (..., H)

    @staticmethod
    def backward(ctx, grad_rows):
        if torch.is_grad_enabled():
            raise RuntimeError("a tied embedding routed by tied_rows_into_grad has no differentiable gradient")
        (ids,) = ctx.saved_tensors
        weight, padding_idx = ctx.embedding.weight, ctx.embedding.padding_idx
        ids = ids.reshape(-1)  # (N,)
        grad = grad_rows.reshape(-1, weight.shape[1]).to(weight.dtype)  # (N, H)
        if padding_idx is not None:  # the padding row gets no gradient, as in nn.Embedding's own backward
            grad = grad.masked_fill((ids == padding_idx)[:, None], 0.0)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, grad)
        return None, None, None


def tied_rows_into_grad(model):
    """Route a tied embedding's input-side gradient into ``weight.grad`` row by row (``_RowsIntoGrad``) instead of
    through the embedding's own backward; returns the hook's handle, or None where the model is not tied (or its
    input embedding is not a plain dense ``torch.nn.Embedding``: left as it is).

    The embedding's own backward forms a dense (V, H) gradient (zeros, then its rows added), which autograd then
    adds into the lm_head side's, the dense (V, H) the update's fused loss formed: a second (V, H) at the end of
    every backward (a third from the second micro-batch on, beside ``weight.grad``), 519 MiB at V = 151,936 x 896 in
    float32. Here only the looked-up rows are added. The update calls it on the CPU outside DeepSpeed: ZeRO takes
    gradients from autograd's hooks, and on CUDA ``index_add_`` adds repeated rows with atomics, in an order that
    differs from run to run. Under no_grad (rollouts, old log-probs) the lookup is the embedding's own."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embedding.weight is not head.weight:
        return None
    if (type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None or embedding.scale_grad_by_freq
            or embedding.sparse):  # fmt: skip
        return None  # a lookup of its own (renormed, scaled, sparse): its backward is not index_add_ of the rows
    anchor = torch.zeros((), device=embedding.weight.device, requires_grad=True)

    def lookup(module, args, kwargs, rows):  # the module's own rows (and their graph) are dropped when grad is on
        if not (torch.is_grad_enabled() and module.weight.requires_grad):
            return rows
        ids = args[0] if args else kwargs["input"]
        return _RowsIntoGrad.apply(ids, module, anchor)

    return embedding.register_forward_hook(lookup, with_kwargs=True)


def as_head(model):
    """A PolicyHead, DeepSpeed's engine around one (it has .module), or a bare causal LM wrapped in one."""
    return model if isinstance(model, PolicyHead) or hasattr(model, "module") else PolicyHead(model)


def run_dummy(head, device: torch.device, *, temperature: float, with_loss: bool = False):
    """The forward of a one-sequence micro-batch (one prompt and one response token, both id 0), for a rank with
    fewer micro-batches than another: under ZeRO-3 every forward and backward gathers parameters collectively, so
    all ranks must run as many, down the same path (ZeRO-3 checks that the ranks traced the same modules).
    Returns log-probs (1,), or with ``with_loss`` the ``linear_policy_loss`` of a zero advantage (the update's
    path): the caller multiplies either by 0."""
    mb = pack_micro_batch([[0]], [[0]], 0)
    loss = None
    if with_loss:
        loss = MicroBatchLossInputs(
            advantages=torch.zeros(1, device=device), cu_seqlens=torch.tensor([0, 1], device=device)
        )
    return _forward(head, mb, mb.input_ids[0, 1:].to(device), temperature, False, loss)


def micro_batch_logprobs(
    head, batch: RolloutBatch, mb: MicroBatch, *, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (n,) of the response tokens of one micro-batch of ``batch`` (entropies too when asked)."""
    lo, hi = batch.bounds[mb.first], batch.bounds[mb.last]
    return _forward(head, mb, batch.response_ids[lo:hi], temperature, with_entropy)


def micro_batch_loss(head, batch: RolloutBatch, mb: MicroBatch, *, temperature: float, loss: MicroBatchLossInputs):
    """``linear_policy_loss`` of one micro-batch of ``batch``: ``(loss, stats, logp)``; ``loss`` holds its inputs,
    sliced to the micro-batch's sequences."""
    lo, hi = batch.bounds[mb.first], batch.bounds[mb.last]
    return _forward(head, mb, batch.response_ids[lo:hi], temperature, False, loss)


def _forward(head, mb: MicroBatch, targets: torch.Tensor, temperature: float, with_entropy: bool, loss=None):
    device = targets.device
    return head(
        mb.input_ids.to(device, non_blocking=True),
        mb.position_ids.to(device, non_blocking=True),
        Packing.of(mb.lengths, device, expand=mb.expand, keep=mb.keep),
        mb.hidden_index.to(device, non_blocking=True),
        targets,
        temperature,
        with_entropy,
        loss,
    )


def bf16_context(device: torch.device, on: bool):
    """bf16 autocast on ``device``'s type where ``on``, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def no_grad_logprobs(model, batch: RolloutBatch, plan: list[MicroBatch], *, temperature: float, bf16: bool,
                     pad_to: int = 0) -> torch.Tensor:  # fmt: skip
    """``response_logprobs``' log-probs (N,) without gradients, under bf16 autocast where ``bf16``: the pass of the
    old and reference log-probs, and of a rollout worker's push check."""
    with torch.no_grad(), bf16_context(batch.response_ids.device, bf16):
        return response_logprobs(model, batch, plan, temperature=temperature, pad_to=pad_to)[0]


def batch_logprobs(model, batch: RolloutBatch, *, micro_batch_tokens: int, temperature: float, bf16: bool, dist=None,
                   zero3_collectives: bool = False) -> torch.Tensor:  # fmt: skip
    """Log-probs (N,) of ``batch``'s response tokens under ``model`` without gradients, in micro-batches of
    ``micro_batch_tokens``: the one pass of the old and reference log-probs (``Actor.logprobs``) and of a push check's
    probe on either side, so that equal weights give equal numbers. ``zero3_collectives``: the forwards gather
    parameters collectively, so every rank of ``dist`` runs as many (the ones with fewer pad with dummy forwards)."""
    plan = plan_micro_batches(batch, micro_batch_tokens)
    pad_to = distributed.max_over_ranks(dist, len(plan)) if zero3_collectives else 0
    return no_grad_logprobs(model, batch, plan, temperature=temperature, bf16=bf16, pad_to=pad_to)


def response_logprobs(
    model,
    batch: RolloutBatch,
    plan: list[MicroBatch],
    *,
    temperature: float,
    with_entropy: bool = False,
    pad_to: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of the batch's response tokens under ``model`` (a causal LM, its ``PolicyHead`` or DeepSpeed's
    engine) at the sampling temperature, micro-batch by micro-batch of ``plan`` (``plan_micro_batches``), and the
    per-token entropy when asked; differentiable when grad is enabled. ``pad_to``: run dummy forwards until this
    many micro-batches ran (under ZeRO-3 every rank must run as many)."""
    head = as_head(model)
    parts = [micro_batch_logprobs(head, batch, mb, temperature=temperature, with_entropy=with_entropy) for mb in plan]
    for _ in range(len(plan), pad_to):
        run_dummy(head, batch.response_ids.device, temperature=temperature)
    logp = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return logp, entropy


SEQUENCE_INPUTS = ("advantages", "first_advantages")  # UpdateInputs' fields of one entry per sequence
TOKEN_INPUTS = ("old_logp", "ref_logp", "is_weights")  # and per token


@dataclass(frozen=True)
class UpdateInputs:
    """What the update needs of a step: the batch and its tensors, named as the loss kernel names them
    (``PolicyLossInputs``), each cut with the batch (``SEQUENCE_INPUTS``, ``TOKEN_INPUTS``); None where not used."""

    batch: RolloutBatch
    advantages: torch.Tensor  # (S,) every token's, but the first's where first_advantages is given
    first_advantages: torch.Tensor | None = None  # (S,) the first (mode) tokens' own (fasttnt.advantages)
    old_logp: torch.Tensor | None = None  # (N,) pi_old's ("half": log 0.5 at the forced first tokens); None: on-policy
    ref_logp: torch.Tensor | None = None  # (N,) the reference model's (the KL term)
    is_weights: torch.Tensor | None = None  # (N,) per-token weights of the policy-gradient term (fasttnt.modes)

    def group_slice(self, first: int, last: int) -> UpdateInputs:
        """Prompts ``first .. last - 1`` (``RolloutBatch.group_slice``) and their tensors."""
        k, bounds = self.batch.group_size, self.batch.bounds
        return self._cut(self.batch.group_slice(first, last), slice(first * k, last * k),
                         slice(bounds[first * k], bounds[last * k]))  # fmt: skip

    def select(self, keep: list[int]) -> UpdateInputs:
        """Sequences ``keep``, in that order (``RolloutBatch.select``), and their tensors."""
        kept, tokens = self.batch.select(keep)
        return self._cut(kept, torch.tensor(keep, dtype=torch.long, device=self.advantages.device), tokens)

    def _cut(self, batch: RolloutBatch, sequences, tokens) -> UpdateInputs:
        cut = {name: t[sequences] for name in SEQUENCE_INPUTS if (t := getattr(self, name)) is not None}
        cut |= {name: t[tokens] for name in TOKEN_INPUTS if (t := getattr(self, name)) is not None}
        return replace(self, batch=batch, **cut)

    def micro_batch(self, mb: MicroBatch, **totals) -> MicroBatchLossInputs:
        """``linear_policy_loss``'s inputs for micro-batch ``mb`` of this batch; ``totals``: the normalisers and
        settings of ``MicroBatchLossInputs``."""
        lo, hi = self.batch.bounds[mb.first], self.batch.bounds[mb.last]
        cut = {name: t[mb.first : mb.last] for name in SEQUENCE_INPUTS if (t := getattr(self, name)) is not None}
        cut |= {name: t[lo:hi] for name in TOKEN_INPUTS if (t := getattr(self, name)) is not None}
        return MicroBatchLossInputs(cu_seqlens=self.batch.cu_seqlens[mb.first : mb.last + 1] - lo, **cut, **totals)
