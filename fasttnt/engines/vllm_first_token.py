"""Forced thinking in vLLM: ``</think>`` forbidden as the first generated token of the requests that ask for it,
as the hf engine does (``Prompt.forbid_think_end_first``). Imports vLLM: only the vllm engine imports this module.

vLLM's ``SamplingParams`` has no per-request logits processors, and ``bad_words``, ``allowed_token_ids`` and
``logit_bias`` act at every position; a batch-level processor, passed as ``LLM(logits_processors=[...])`` and
switched on per request with ``SamplingParams(extra_args={KEY: token_id})``, masks the first position only. Each of
vLLM's two model runners has its own processor interface, and refuses the other's; ``processor_for`` picks:

* ``ForbidFirstToken``, the V1 runner's (``vllm/v1/sample/logits_processor/interface.py``, 0.31 to 0.33; the
  package is gone in 0.34, where this class is not defined). The runner hands it batch-row changes
  (``BatchUpdate``: added, removed, moved) with each request's live list of output ids; a row is masked until that
  list holds a token.
* ``ForbidFirstTokenV2``, the V2 runner's (``vllm/v1/worker/gpu/sample/logits_processor/interface.py``, the same
  from 0.31 to 0.34; the only V2 runner in 0.34). Requests are persistent slots: ``add_request(slot, params)``
  (re)initialises one (no removal hook: a recycled slot is overwritten), and ``apply(logits, ctx)`` maps each logits
  row to its slot (``ctx.expanded_idx_mapping``) and gives the position of the token fed at the row (``ctx.pos``). A
  row samples its request's first output token when ``pos + 1`` equals the request's prompt length
  (``req_states.prompt_len``, the user prompt without any output a resumed request is re-fed), exactly once per
  request: later rows, a resumed request's and speculative drafts' sit further on, a partial prefill's earlier (its
  sample is discarded). The V2 sampler (``vllm/v1/worker/gpu/sample/sampler.py``) calls ``add_request`` after the
  runner's ``req_states`` take the request, so the prompt length is known there.

Both samplers apply these processors before temperature and top-p, so the log-prob vLLM reports for the first
token (``processed_logprobs``) is under the renormalised, masked distribution, as the hf engine's.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

try:  # the V1 runner's interface: removed with the runner in vLLM 0.34
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:
    V1LogitsProcessor = None

KEY = "fasttnt_forbid_first_token"


def forbidden_token(params: SamplingParams) -> int | None:
    """The token id a request forbids as its first generated token, or None; anything else is refused at admission
    (``validate_params``)."""
    token = (params.extra_args or {}).get(KEY)
    if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
        raise ValueError(f"{KEY} must be a token id, got {token!r}")
    return token


def processor_for(v1_runner: bool) -> type:
    """The processor class for the model runner the engine runs."""
    if not v1_runner:
        return ForbidFirstTokenV2
    if V1LogitsProcessor is None:
        raise RuntimeError("this vLLM has no V1 model runner (removed in 0.34): its V2 runner is the only one")
    return ForbidFirstToken


if V1LogitsProcessor is not None:

    class ForbidFirstToken(V1LogitsProcessor):
        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
            self.device = device
            self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (token id, the row's live output ids)
            self.index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to mask

        @classmethod
        def validate_params(cls, params: SamplingParams) -> None:
            forbidden_token(params)

        def is_argmax_invariant(self) -> bool:
            return False  # it changes which token is the most likely: applied before temperature, greedy included

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            def new_state(params, _prompt_ids, output_ids):
                token = forbidden_token(params)
                return None if token is None else (token, output_ids)

            changed = process_dict_updates(self.rows, batch_update, new_state)
            done = [row for row, (_, out) in self.rows.items() if out]  # the live output list: its first token is out
            for row in done:
                del self.rows[row]
            if changed or done:
                rows = list(self.rows)
                self.index = None
                if rows:
                    tokens = [self.rows[r][0] for r in rows]
                    self.index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if self.index is not None:
                logits[self.index] = float("-inf")
            return logits


class ForbidFirstTokenV2(V2LogitsProcessor):
    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        # a UvaBackedTensor whose .gpu the runner re-points at each flush: read at apply, never kept
        self.prompt_len = req_states.prompt_len
        self.tokens = np.full(req_states.max_num_reqs, -1, dtype=np.int64)  # slot -> forbidden token id, -1: none
        self.tokens_on_device = torch.full((req_states.max_num_reqs,), -1, dtype=torch.int64, device=req_states.device)
        self.staged = False

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forbidden_token(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        token = forbidden_token(sampling_params)
        self.tokens[req_idx] = -1 if token is None else token  # a recycled slot: its last occupant's token goes
        self.staged = True
        return token is not None

    def apply_staged_writes(self) -> None:
        if self.staged:  # stream-ordered after the last step's reads of the slots it rewrites
            self.tokens_on_device.copy_(torch.from_numpy(self.tokens))
            self.staged = False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not (self.tokens[ctx.idx_mapping_np] >= 0).any():
            return logits
        slots = ctx.expanded_idx_mapping
        tokens = self.tokens_on_device[slots]
        first = (ctx.pos + 1 == self.prompt_len.gpu[slots]) & (tokens >= 0)
        # without a host sync: every row writes back its own logit at one column, -inf where it is forbidden
        column = tokens.clamp(min=0).unsqueeze(1)
        kept = logits.gather(1, column)
        logits.scatter_(1, column, kept.masked_fill(first.unsqueeze(1), float("-inf")))
        return logits
