"""Forced thinking's first-token processors (fasttnt/engines/vllm_first_token.py): the V2 model runner's against the
V1 runner's on CPU tensors, driven as each runner drives them (V1: batch-row updates with live output lists; V2:
request slots from vLLM's own ``RequestState``, rows reordered each step), the same requests, logits and steps; and
the engine's gate on vLLM's release. The processor tests need vLLM (skipped without it); the V1 processor exists
up to vLLM 0.33. The V2 runner itself has not run with the engine: no CPU build has it."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch
from support import vllm_standin

from fasttnt.engines.vllm import vllm_release

FORBIDDEN = 7  # the token the keyed requests forbid first
VOCAB, MAX_REQS = 16, 8


def _modules():
    pytest.importorskip("vllm")
    from fasttnt.engines import vllm_first_token

    if not hasattr(vllm_first_token, "ForbidFirstToken"):
        pytest.skip("this vLLM has no V1 model runner to compare with")
    return vllm_first_token


def _request_state(monkeypatch):
    """vLLM's own per-slot request state, on the CPU: its buffers fall back to plain tensors where there is no
    pinned memory (``vllm/v1/worker/gpu/buffer_utils.py``)."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    return RequestState(MAX_REQS, 64, 64, 0, VOCAB, torch.device("cpu"))


class Runs:
    """The two processors, each fed as its runner feeds it."""

    def __init__(self, monkeypatch) -> None:
        self.m = _modules()
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

        self.req_states = _request_state(monkeypatch)
        self.v1 = self.m.ForbidFirstToken(None, torch.device("cpu"), False)
        self.v2 = self.m.ForbidFirstTokenV2(None, LogitsProcRequestState.from_request_state(self.req_states))
        self.rows: list[str] = []  # V1's persistent batch: row -> request (condensed after removals)
        self.prompt: dict[str, int] = {}
        self.output: dict[str, list[int]] = {}  # the live output lists V1 holds
        self.keyed: dict[str, bool] = {}
        self.added: list = []
        self.removed: list[int] = []
        self.moved: list = []

    def add(self, req: str, prompt_len: int, keyed: bool) -> None:
        from vllm import SamplingParams

        params = SamplingParams(extra_args={self.m.KEY: FORBIDDEN} if keyed else None)
        self.prompt[req], self.output[req], self.keyed[req] = prompt_len, [], keyed
        # V1: the lowest freed row first, else a new row at the end (vllm/v1/worker/gpu_input_batch.py add_request)
        row = min(self.removed) if self.removed else len(self.rows)
        if row in self.removed:
            self.removed.remove(row)
            self.rows[row] = req
        else:
            self.rows.append(req)
        self.added.append((row, params, list(range(prompt_len)), self.output[req]))
        # V2: a slot from the free list, then the sampler (vllm/v1/worker/gpu/model_runner.py add_requests)
        self.req_states.add_request(req, prompt_len, list(range(prompt_len)), 0, 32)
        self.v2.add_request(self.req_states.req_id_to_index[req], params)

    def remove(self, req: str) -> None:
        row = self.rows.index(req)
        self.rows[row] = None
        self.removed.append(row)
        self.req_states.remove_request(req)

    def step(self, rng: random.Random) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One sampling step: per request (input logits, V1's output, V2's output); then a token out for each."""
        from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        # V1: holes filled from the end (condense), then a swap: the moves its input batch reports
        for hole in sorted(self.removed):
            while self.rows and self.rows[-1] is None:
                self.rows.pop()
            if hole < len(self.rows):
                self.rows[hole] = self.rows.pop()
                self.moved.append((len(self.rows), hole, MoveDirectionality.UNIDIRECTIONAL))
        self.rows = [r for r in self.rows if r is not None]
        if len(self.rows) > 2:
            self.rows[0], self.rows[1] = self.rows[1], self.rows[0]
            self.moved.append((0, 1, MoveDirectionality.SWAP))
        changed = self.added or self.removed or self.moved
        update = BatchUpdate(len(self.rows), self.removed, self.added, self.moved) if changed else None
        self.v1.update_state(update)
        self.added, self.removed, self.moved = [], [], []
        # V2: the runner's flush, then rows in an order of their own
        self.req_states.prompt_len.copy_to_uva()
        self.v2.apply_staged_writes()
        order = self.rows[:]
        rng.shuffle(order)
        slots = np.array([self.req_states.req_id_to_index[r] for r in order], dtype=np.int32)
        pos = [self.prompt[r] - 1 + len(self.output[r]) for r in order]  # the position of the token fed
        ctx = LogitsContext(
            expanded_idx_mapping=torch.from_numpy(slots),
            idx_mapping=torch.from_numpy(slots),
            idx_mapping_np=slots,
            expanded_local_pos=torch.zeros(len(order), dtype=torch.int32),
            input_ids=torch.zeros(len(order), dtype=torch.int32),
            pos=torch.tensor(pos, dtype=torch.int64),
            seq_lens_upper_bound_np=np.array(pos, dtype=np.int32) + 1,
        )
        given = {r: torch.tensor([rng.gauss(0, 3) for _ in range(VOCAB)], dtype=torch.float32) for r in self.rows}
        out1 = self.v1.apply(torch.stack([given[r] for r in self.rows]))
        out2 = self.v2.apply(torch.stack([given[r] for r in order]), ctx)
        result = {r: (given[r], out1[self.rows.index(r)], out2[order.index(r)]) for r in self.rows}
        for r in self.rows:
            self.output[r].append(rng.randrange(VOCAB))
        return result


def test_v2_masks_what_v1_masks_and_leaves_every_other_logit(monkeypatch):
    runs, rng = Runs(monkeypatch), random.Random(0)
    forced = unforced = 0
    names = iter(f"r{i}" for i in range(100))
    live: list[str] = []
    for step in range(12):
        for req in rng.sample(live, k=min(len(live), rng.randrange(3))) if step else []:
            runs.remove(req)
            live.remove(req)
        for _ in range(rng.randrange(1, 4) if len(live) < MAX_REQS - 3 else 0):
            live.append(req := next(names))
            runs.add(req, prompt_len=rng.randrange(1, 9), keyed=rng.random() < 0.6)
        expected = {r for r in live if runs.keyed[r] and not runs.output[r]}  # keyed, at its first token
        for req, (given, v1, v2) in runs.step(rng).items():
            masked = {(req, t) for t in range(VOCAB) if v2[t] == float("-inf")}
            assert masked == {(req, t) for t in range(VOCAB) if v1[t] == float("-inf")}
            assert masked == ({(req, FORBIDDEN)} if req in expected else set())
            keep = torch.ones(VOCAB, dtype=torch.bool)
            keep[FORBIDDEN] = req not in expected
            assert torch.equal(v2[keep], given[keep]) and torch.equal(v1[keep], given[keep])  # bit for bit
            forced += req in expected
            unforced += runs.keyed[req] and req not in expected
    assert forced >= 5 and unforced >= 5  # keyed requests at their first token and past it both ran
    assert runs.req_states.free_indices != list(range(MAX_REQS))  # slots were recycled


def test_v2_rows_that_are_not_the_first_token(monkeypatch):
    """A request's rows that do not sample its first output token: a partial prefill's (its sample is discarded), a
    speculative draft's beyond the first, a request resumed with output it had already (prefill_len > prompt_len)."""
    m = _modules()
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

    req_states = _request_state(monkeypatch)
    v2 = m.ForbidFirstTokenV2(None, LogitsProcRequestState.from_request_state(req_states))
    params = SamplingParams(extra_args={m.KEY: FORBIDDEN})
    req_states.add_request("chunked", 6, list(range(6)), 0, 8)
    req_states.add_request("drafts", 4, list(range(4)), 0, 8)
    req_states.add_request("resumed", 3, list(range(5)), 0, 8)  # 2 output tokens re-fed with its prompt
    for req in ("chunked", "drafts", "resumed"):
        v2.add_request(req_states.req_id_to_index[req], params)
    req_states.prompt_len.copy_to_uva()
    v2.apply_staged_writes()
    slot = [req_states.req_id_to_index[r] for r in ("chunked", "drafts", "drafts", "drafts", "resumed")]
    ctx = LogitsContext(
        expanded_idx_mapping=torch.tensor(slot, dtype=torch.int32),
        idx_mapping=torch.tensor(sorted(set(slot)), dtype=torch.int32),
        idx_mapping_np=np.array(sorted(set(slot)), dtype=np.int32),
        expanded_local_pos=torch.tensor([0, 0, 1, 2, 0], dtype=torch.int32),
        input_ids=torch.zeros(5, dtype=torch.int32),
        pos=torch.tensor([2, 3, 4, 5, 4]),  # chunked: 3 of 6 prompt tokens; drafts: its first token and 2 drafts
        seq_lens_upper_bound_np=np.array([3, 6, 5], dtype=np.int32),
    )
    logits = torch.zeros(5, VOCAB)
    v2.apply(logits, ctx)
    assert torch.isinf(logits).nonzero().tolist() == [[1, FORBIDDEN]]  # the draft request's first token only


def test_a_bad_token_is_refused_at_admission():
    m = _modules()
    from vllm import SamplingParams

    for bad in ("7", 7.0, -1, True):
        for cls in (m.ForbidFirstToken, m.ForbidFirstTokenV2):
            with pytest.raises(ValueError, match=m.KEY):
                cls.validate_params(SamplingParams(extra_args={m.KEY: bad}))
    m.ForbidFirstTokenV2.validate_params(SamplingParams(extra_args={m.KEY: FORBIDDEN}))


def test_the_module_imports_without_the_v1_interface(monkeypatch):
    """vLLM 0.34 removed ``vllm.v1.sample.logits_processor`` with the V1 runner: the module still imports, with the
    V2 processor only."""
    pytest.importorskip("vllm")
    import importlib

    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", None)  # import fails, as on 0.34
    monkeypatch.delitem(sys.modules, "fasttnt.engines.vllm_first_token", raising=False)
    m = importlib.import_module("fasttnt.engines.vllm_first_token")
    assert not hasattr(m, "ForbidFirstToken")
    assert m.processor_for(v1_runner=False) is m.ForbidFirstTokenV2
    with pytest.raises(RuntimeError, match="no V1 model runner"):
        m.processor_for(v1_runner=True)


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.1", "0.34.0", "0.34.0rc1", "0.32.0+cpu"])
def test_the_gate_takes_vllm_031_to_034(version):
    assert (0, 31) <= vllm_release(version) <= (0, 34)


@pytest.mark.parametrize("version", ["0.30.2", "0.35.0", "1.0.0", "0.3.1", "dev"])
def test_the_gate_refuses_other_releases_in_one_line(version):
    with pytest.raises(RuntimeError, match=r"^the vllm engine supports vLLM 0\.31 to 0\.34 .*found " + version):
        vllm_release(version)


def test_on_vllm_034_the_engine_leaves_the_runner_to_vllm(tmp_path, monkeypatch):
    """0.34 has only the V2 runner (``VLLM_USE_V2_MODEL_RUNNER=0`` is an error there): the engine sets nothing and
    does not ask which runner was built (against the stand-in of tests/support/vllm_standin.py)."""
    from test_vllm_engine import _engine_folder

    from fasttnt.engines import EngineSettings
    from fasttnt.engines.vllm import VLLMEngine

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(key, "unset")  # restored after the test, whatever the engine sets
        monkeypatch.delenv(key)
    standin = vllm_standin.install(monkeypatch)
    monkeypatch.setattr(standin, "__version__", "0.34.0")
    tok, folder = _engine_folder(tmp_path)
    engine = VLLMEngine(None, tok, EngineSettings(max_new_tokens=4, model_path=folder))
    assert not engine.v1_runner and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    engine.close()
    monkeypatch.setattr(standin, "__version__", "0.33.1")
    engine = VLLMEngine(None, tok, EngineSettings(max_new_tokens=4, model_path=folder))
    assert engine.v1_runner and not engine.llm.llm_engine.vllm_config.use_v2_model_runner
    engine.close()
