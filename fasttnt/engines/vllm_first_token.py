"""Forced thinking in vLLM: ``</think>`` forbidden as the first generated token of the requests that ask for it,
as the hf engine does (``Prompt.forbid_think_end_first``). Imports vLLM: only the vllm engine imports this module.

vLLM 0.31's ``SamplingParams`` has no per-request logits processors, and ``bad_words``, ``allowed_token_ids`` and
``logit_bias`` act at every position; a batch-level processor of vLLM's V1 interface
(``vllm/v1/sample/logits_processor/interface.py``), passed as ``LLM(logits_processors=[ForbidFirstToken])`` and
switched on per request with ``SamplingParams(extra_args={KEY: token_id})``, masks the first position only. The V1
sampler applies it before temperature and top-p (``vllm/v1/sample/sampler.py``), so the log-prob vLLM reports for
the first token is under the renormalised, masked distribution, as the hf engine's. It needs the V1 model runner:
the CPU build always has it (Model Runner V2 needs Triton); on CUDA the vllm engine selects it with
``VLLM_USE_V2_MODEL_RUNNER=0`` when it is built for forced thinking (V2 has another interface and refuses V1
processors, ``vllm/v1/worker/gpu/sample/logits_processor/loader.py``).
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

KEY = "fasttnt_forbid_first_token"


class ForbidFirstToken(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (token id, the row's live output ids)
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to mask

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        token = (params.extra_args or {}).get(KEY)
        if token is not None and not isinstance(token, int):
            raise ValueError(f"{KEY} must be a token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is the most likely: applied before temperature, greedy included

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params, _prompt_ids, output_ids):
            token = (params.extra_args or {}).get(KEY)
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
