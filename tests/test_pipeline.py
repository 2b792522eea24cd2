"""Generation apart from training (``fasttnt.pipeline``): the staleness bound by hand, a scored batch and a weight
push between two processes (gloo) arriving bit for bit, and the malformed ones refused with a line that names the
sender."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch
from support import varied
from support.small import (
    SEED,
    SMALL,
    TINY,
    deterministic,
    free_port,
    kill_job,
    launch_command,
    metric_rows,
    run_job,
    run_ranks,
    train,
    warmups,
)

from fasttnt.checkpoint import list_checkpoints
from fasttnt.embedded.char_tokenizer import build_char_tokenizer
from fasttnt.engines.batch import RolloutBatch
from fasttnt.pipeline.peer import link
from fasttnt.pipeline.remote import IN_FLIGHT, in_flight_file, read_in_flight
from fasttnt.pipeline.staleness import StaleBatchError, check_fresh, oldest_version, staleness
from fasttnt.pipeline.weights import Slot, WeightPushError, layout, recv_weights, send_weights
from fasttnt.pipeline.wire import OPTIONAL, Limits, Shipment, WorkerError, encode, from_fields, to_fields
from fasttnt.scoring import Judged, ScoredBatch
from fasttnt_kernels import TntRewards

pytest.importorskip("deepspeed")  # distributed.init joins the process group through DeepSpeed

ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
HANG_S = 300  # each job takes seconds; a hang fails after this, its ranks killed with it
# scored_batch's shipments at the limits: its 12 responses of at most 8 tokens, after prompts of at most 5, every id
# under 100
LIMITS = Limits(rows=12, row_tokens=8, vocab=100)


def test_the_staleness_bound_by_hand():
    # step t trains on version t - 1: on-policy (k = 0) only that version's batch is fresh; at k = 2 step 5 (version
    # 4) may train on versions 2, 3 and 4; the first steps never ask for a version below 0
    assert [oldest_version(t, 0) for t in (1, 2, 5)] == [0, 1, 4]
    assert [oldest_version(t, 2) for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert staleness(5, 2) == 2 and staleness(1, 0) == 0
    for version in (2, 3, 4):
        check_fresh(5, version, 2, worker="w")
    with pytest.raises(StaleBatchError, match=r"w: step 5's batch was sampled with weight version 1, 3 behind, past "
                       r"rollout.max_staleness=2"):  # fmt: skip
        check_fresh(5, 1, 2, worker="w")
    with pytest.raises(StaleBatchError, match="version 5, which the trainer has not made yet"):
        check_fresh(5, 5, 2, worker="w")
    check_fresh(1, 0, 0, worker="w")
    with pytest.raises(StaleBatchError, match="1 behind"):
        check_fresh(2, 0, 0, worker="w")


def scored_batch(seed: int, *, optional: bool = True, groups: int = 3) -> ScoredBatch:
    """A scored batch of ``groups`` groups of 4 with every field filled from ``seed`` (texts with non-ASCII
    characters; the optional fields only if ``optional``): the same on every process that asks for the same seed."""
    g = torch.Generator().manual_seed(seed)
    k = 4
    s = groups * k
    lengths = torch.randint(1, 9, (s,), generator=g)
    cu = torch.zeros(s + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    prompts = [torch.randint(0, 50, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist()
               for _ in range(s // k) for _ in range(k)]  # fmt: skip
    batch = RolloutBatch(
        prompts, torch.randint(0, 100, (n,), generator=g), cu, torch.rand(s, generator=g) < 0.3, k,
        rollout_logp=-torch.rand(n, generator=g) if optional else None,
        forced=torch.randint(0, 3, (s,), generator=g, dtype=torch.int8) if optional else None,
        behaviour_first_logp=-torch.rand(s, generator=g) if optional else None,
        behaviour_think_end_logp=-torch.rand(s // k, generator=g).repeat_interleave(k) if optional else None,
    )  # fmt: skip
    texts = [f"réponse {i} → {int(torch.randint(0, 999, (), generator=g))}" for i in range(s)]
    judged = Judged(texts, torch.rand(s, generator=g) < 0.5, timeouts=2, crashes=1)
    solution_len = torch.randint(-1, 30, (s,), generator=g, dtype=torch.int32)
    rewards = TntRewards(torch.randn(s, generator=g), torch.rand(s, generator=g) < 0.5, solution_len,
                         torch.rand(s // k, generator=g))  # fmt: skip
    hacked = torch.rand(s, generator=g) < 0.2 if optional else None
    levels = torch.randint(-1, 5, (s,), generator=g) if optional else None
    return ScoredBatch(batch, judged, rewards, hacked=hacked, levels=levels)


def assert_same_batch(got: ScoredBatch, want: ScoredBatch) -> None:
    """Every field equal, dtype included (``to_fields`` names them all)."""
    a, b = to_fields(got), to_fields(want)
    assert a.keys() == b.keys()
    for name in a:
        if b[name] is None:
            assert a[name] is None, name
        else:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert got.batch.prompt_ids == want.batch.prompt_ids and got.judged.texts == want.judged.texts
    assert got.batch.responses == want.batch.responses and got.batch.bounds == want.batch.bounds
    assert got.rewards.solution_len.dtype == torch.int32 and got.judged.correct.dtype == torch.bool


@pytest.mark.parametrize("optional", [True, False])
def test_the_fields_of_a_scored_batch_round_trip(optional):
    want = scored_batch(SEED, optional=optional)
    fields = to_fields(want)
    assert all((fields[name] is None) == (not optional) for name in OPTIONAL), "precondition: the optional fields"
    assert_same_batch(from_fields(fields, worker="w", vocab=LIMITS.vocab), want)


def shipment(seed: int, step: int, version: int | None = None, **fields) -> Shipment:
    """Step ``step``'s shipment of ``scored_batch(seed)`` (3 groups), sampled with ``version`` (default step - 2)."""
    return Shipment(scored_batch(seed), step, step - 2 if version is None else version, [True, False, True],
                    data_position=8 * step, **{"times": {"time_generate": 1.0}, **fields})  # fmt: skip


def test_the_workers_shipments_join_in_worker_order():
    from fasttnt.dynamic_sampling import concat_draws
    from fasttnt.pipeline.remote import whole_step

    first = shipment(SEED, 4, times={"time_generate": 2.0, "time_idle": 0.5})
    second = replace(shipment(SEED + 1, 4, version=1, times={"time_generate": 1.5, "time_idle": 0.7}, stop=True),
                     varied=[False, False, True])  # fmt: skip
    assert first.varied != second.varied, "precondition: the workers' flags tell them apart"
    whole = whole_step([first, second])
    # the groups, and the flags of each, in the workers' order (what the trainers choose from and share)
    assert_same_batch(whole.scored, concat_draws([first.scored, second.scored]))
    assert whole.varied == first.varied + second.varied
    # the oldest weights, the slowest worker's seconds, a stop asked of any
    assert (whole.step, whole.version, whole.stop) == (4, 1, True)
    assert whole.times == {"time_generate": 2.0, "time_idle": 0.7}
    assert whole_step([first]) is first


def test_the_batches_in_flight_read_back_per_worker_and_a_checkpoint_of_other_workers_is_refused(tmp_path):
    from fasttnt.checkpoint import ResumeError
    from fasttnt.config import load_config
    from fasttnt.pipeline.push import WeightPush
    from fasttnt.pipeline.remote import RemoteRollouts
    from fasttnt.pipeline.roles import Pipeline, PipelineRanks

    def trainer(workers: int, saved: dict) -> RemoteRollouts:
        (tmp_path / IN_FLIGHT).unlink(missing_ok=True)
        torch.save(saved, tmp_path / IN_FLIGHT)
        cfg = load_config(None, [f"rollout.workers={workers}", "rollout.max_staleness=1", "rollout.prompts_per_step=4"])
        pipeline = Pipeline(PipelineRanks(1 + workers, workers), 0, None, ("127.0.0.1", 0), 1.0)
        push = WeightPush(cfg, pipeline, torch.device("cpu"))
        return RemoteRollouts(cfg, pipeline, torch.device("cpu"), tmp_path, push)

    two = in_flight_file([shipment(SEED, 3), shipment(SEED + 1, 3)], [[shipment(SEED + 2, 4), shipment(SEED + 3, 4)]],
                         {3: [torch.zeros(5), torch.ones(5)]})  # fmt: skip
    got = trainer(2, two)
    assert [s.step for s in got.push.last] == [3, 3] and [[s.step for s in q] for q in got.queue] == [[4, 4]]
    assert_same_batch(got.queue[0][1].scored, scored_batch(SEED + 3))
    assert [p.tolist() for p in got.push.probes[3]] == [[0.0] * 5, [1.0] * 5]
    one = in_flight_file([shipment(SEED, 3)], [[shipment(SEED + 2, 4)]], {3: [torch.ones(5)]})
    got = trainer(1, one)
    assert [s.step for s in got.push.last] == [3] and [len(q) for q in got.queue] == [1]
    assert len(got.push.probes[3]) == 1
    with pytest.raises(ResumeError, match=r"the batches of 2 rollout workers, and this run has rollout.workers=1"):
        trainer(1, two)


def test_the_trainers_share_a_step_as_the_colocated_ranks_share_its_prompts():
    from fasttnt.dynamic_sampling import choose_groups, concat_draws, select_groups
    from fasttnt.pipeline.remote import trainer_share
    from fasttnt.rollouts import Provenance

    made = Provenance(data_position=8, generate_seconds=1.5)  # where the step came from: each share carries it
    drawn = scored_batch(SEED, groups=8)  # two draws of 4 prompts, as a worker ships them
    assert (drawn.judged.timeouts, drawn.judged.crashes) == (2, 1), "precondition: the verifier's counts to keep"
    # one trainer trains on the whole step, as it did alone
    whole = trainer_share(drawn, [True] * 8, list(range(8)), 0, 2, made, rank=0, trainers=1)
    assert whole.drawn is drawn and whole.trained is drawn and (whole.filled, whole.draws) == (0, 2)
    assert whole.provenance is made
    # without dynamic sampling trainer r trains on (and logs) the r-th half of the groups: the prompts the colocated
    # rank r draws; the halves, joined, are the step, the verifier's counts once
    varied = [False, True, False, True, False, False, True, False]
    halves = [trainer_share(drawn, varied, list(range(8)), 0, 2, made, rank=r, trainers=2) for r in (0, 1)]
    assert [h.trained is h.drawn for h in halves] == [True, True]
    assert_same_batch(concat_draws([h.drawn for h in halves]), drawn)
    assert [h.varied for h in halves] == [varied[:4], varied[4:]] and [h.filled for h in halves] == [0, 0]
    assert [(h.drawn.judged.timeouts, h.drawn.judged.crashes) for h in halves] == [(2, 1), (0, 0)]
    # dynamic sampling: the step's 4 groups are chosen from the whole shipment (3 varied, one equal-reward fill),
    # then halved; the fill is trainer 0's, and the logged draws stay halved as above
    groups, filled = choose_groups(varied, 4)
    assert (groups, filled) == ([0, 1, 3, 6], 1), "precondition: a fill among the chosen groups"
    halves = [trainer_share(drawn, varied, groups, filled, 2, made, rank=r, trainers=2) for r in (0, 1)]
    for half, mine in zip(halves, ([0, 1], [3, 6]), strict=True):
        assert_same_batch(half.trained, select_groups(drawn, mine))
    assert [h.filled for h in halves] == [1, 0] and [h.varied for h in halves] == [varied[:4], varied[4:]]
    assert_same_batch(concat_draws([h.drawn for h in halves]), drawn)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # a boundary out of order (the last one still the token count)
        ("cu_seqlens", lambda t: torch.cat([t[:5], t[6:7], t[5:6], t[7:]]), "cu_seqlens does not bound"),
        ("limit", lambda t: t[:2], "limit holds 2 groups"),
        ("truncated", lambda t: t[:11], "truncated holds 11, not 12"),
        ("text_lengths", lambda t: t + 1, "text_lengths do not add up"),
        ("counts", lambda t: torch.tensor([5, 0, 0]), "12 responses are not groups of 5"),
        ("rewards", lambda t: None, r"fields \['rewards'\] missing"),
        # counts of another size, ids outside the vocabulary (the first and last rows), rewards that are not finite
        ("counts", lambda t: t[:2], r"counts holds 2 numbers, not 3"),
        ("counts", lambda t: torch.cat([t, t[:1]]), r"counts holds 4 numbers, not 3"),
        ("response_ids", lambda t: at(t, 0, -1), r"response_ids holds token id -1 \(row 0\), outside the vocabulary "
         r"\[0, 100\)"),
        ("response_ids", lambda t: at(t, -1, 100), r"response_ids holds token id 100 \(row 11\), outside"),
        ("prompt_tokens", lambda t: at(t, -1, -1), r"prompt_tokens holds token id -1 \(row 11\), outside"),
        ("prompt_tokens", lambda t: at(t, 0, 100), r"prompt_tokens holds token id 100 \(row 0\), outside"),
        ("rewards", lambda t: at(t, 5, math.nan), r"rewards holds nan \(row 5\), not a finite number"),
        ("rewards", lambda t: at(t, 0, math.inf), r"rewards holds inf \(row 0\), not a finite number"),
        ("rewards", lambda t: at(t, -1, -math.inf), r"rewards holds -inf \(row 11\), not a finite number"),
    ],
)  # fmt: skip
def test_a_malformed_batch_is_refused_naming_the_worker(field, value, message):
    fields = to_fields(scored_batch(SEED))
    from_fields(dict(fields), worker="w", vocab=LIMITS.vocab)  # precondition: the batch as sent is whole
    fields[field] = value(fields[field])
    with pytest.raises(WorkerError, match=f"rollout worker rank 3: malformed batch: {message}"):
        from_fields(fields, worker="rollout worker rank 3", vocab=LIMITS.vocab)


def at(t: torch.Tensor, i: int, value) -> torch.Tensor:
    """A copy of ``t`` holding ``value`` at ``i``."""
    t = t.clone()
    t[i] = value
    return t


@pytest.mark.parametrize(
    ("field", "count"),
    [*((field, 2**60) for field in ("cu_seqlens", "prompt_tokens", "response_ids", "text_bytes", "counts", "rewards",
                                    "probe_logp")),
     ("rewards", LIMITS.rows + 1), ("counts", 4)],
)  # fmt: skip
def test_a_header_announcing_more_than_a_shipment_holds_is_refused_before_anything_is_allocated(monkeypatch, field,
                                                                                                count):  # fmt: skip
    from fasttnt.pipeline import wire

    sent: list[torch.Tensor] = []  # what the worker's sends put in the trainer's buffers, in order
    monkeypatch.setattr(wire, "recv_from", lambda tensor, src, **_: tensor.copy_(sent.pop(0)))
    empty = torch.empty

    def small_empty(*size, **options):
        n = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()
        assert n <= 1 << 20, f"torch.empty of {n} elements"
        return empty(*size, **options)

    monkeypatch.setattr(torch, "empty", small_empty)
    header, payload = encode(shipment(SEED, 3, probe_version=1, probe_logp=-torch.rand(6)))
    sent += [header, payload]
    got = wire.recv_shipment(3, limits=LIMITS)  # precondition: as sent, at the limits' rows, it arrives whole
    assert_same_batch(got.scored, scored_batch(SEED))
    assert (got.probe_version, got.probe_logp.numel()) == (1, 6)
    header[wire.HEADER_INTS + 2 * [name for name, _ in wire.MESSAGE_FIELDS].index(field) + 1] = count
    sent += [header]
    with pytest.raises(WorkerError, match=rf"rollout worker rank 3: malformed batch: field {field} announces {count} "
                       "elements, more than the"):  # fmt: skip
        wire.recv_shipment(3, limits=LIMITS)
    assert not sent, "the payload was not received"


def in_flight_of_two_workers() -> dict[str, object]:
    return in_flight_file([shipment(SEED, 3), shipment(SEED + 1, 3)], [[shipment(SEED + 2, 4), shipment(SEED + 3, 4)]],
                          {3: [-torch.rand(5), -torch.rand(5)]})  # fmt: skip


def contents(in_flight: tuple) -> tuple:
    """``read_in_flight``'s batches as their messages' numbers, and its probes', to compare."""
    last, queue, probes = in_flight
    messages = [[t.tolist() for t in encode(s)] for s in [*last, *(s for step in queue for s in step)]]
    return messages, [len(step) for step in queue], {v: [(p.dtype, p.tolist()) for p in ps] for v, ps in probes.items()}


def test_a_flipped_bit_in_the_batches_in_flight_is_refused_or_reads_back_unchanged(tmp_path):
    import random

    from fasttnt.checkpoint import ResumeError

    path = tmp_path / IN_FLIGHT
    torch.save(in_flight_of_two_workers(), path)
    raw, want = path.read_bytes(), contents(read_in_flight(path, workers=2))
    rng, refused, flips = random.Random(SEED), 0, range(0, len(raw), 8)  # a bit of every 8th byte, a random one
    for i in flips:
        flipped = bytearray(raw)
        flipped[i] ^= 1 << rng.randrange(8)
        path.write_bytes(flipped)
        try:
            got = read_in_flight(path, workers=2)
        except ResumeError as err:
            assert str(err).startswith(f"--resume: {path}"), err
            refused += 1
            continue
        # a bit of the zip's records that its reader skips, or of padding: the same batches, not others
        assert contents(got) == want, f"byte {i}: a flipped bit read back as other batches"
    assert refused > len(flips) // 2, "precondition: most flips touch what is read"


def test_a_damaged_in_flight_file_is_refused_naming_it_and_what_is_wrong(tmp_path):
    from fasttnt.checkpoint import ResumeError

    path = tmp_path / IN_FLIGHT
    saved = in_flight_of_two_workers()
    torch.save(saved, path)
    raw = path.read_bytes()
    read_in_flight(path, workers=2)  # precondition: as written, it reads back

    def refused(content: bytes | dict, message: str, workers: int = 2) -> None:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        with pytest.raises(ResumeError, match=re.escape(f"--resume: {path}") + message):
            read_in_flight(path, workers=workers)

    for content in (b"", raw[:100], raw[: len(raw) // 2], raw[:-1], b"not a checkpoint"):  # empty, truncated, no zip
        refused(content, r" \w")  # checkpoint.load_tensors' words for what is wrong
    refused({k: v for k, v in saved.items() if k != "queue"}, r": key 'queue' missing")
    old = {"last": [encode(shipment(SEED, 3))], "queue": [], "probes": {}}  # the layout before checksums
    refused(old, r": format None, not 2: written before its batches carried checksums")
    header, payload, digest = saved["queue"][0][1]
    damaged = {**saved, "queue": [[saved["queue"][0][0], (header, at(payload, 40, payload[40] ^ 4), digest)]]}
    refused(damaged, re.escape(": batch queue[0][1] does not match its checksum: the file is damaged"))
    probes, digest = saved["probes"][3]
    refused({**saved, "probes": {3: ([probes[0], probes[1] + 1], digest)}}, re.escape(": probes[3] do not match"))
    refused(saved, " holds the batches of 2 rollout workers, and this run has rollout.workers=1", workers=1)


EXCHANGE = f"""
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_pipeline import assert_same_batch, scored_batch, tiny_model
from fasttnt import distributed
from fasttnt.pipeline.weights import WeightPushError, recv_weights, send_weights
from fasttnt.pipeline.wire import HEADER_LEN, Limits, Shipment, WorkerError, recv_shipment, send_shipment

BUCKET = 4096  # bytes: several buckets, so their order and bounds are exercised
LIMITS = {LIMITS!r}

def main():
    ctx = distributed.init("cpu")
    trainer, worker = 0, 1
    # the worker ships step 7's batch sampled with version 5; the trainer rebuilds the same batch to compare
    if ctx.rank == worker:
        times = {{"time_generate": 1.5, "time_verify": 0.25, "time_reward": 0.125, "time_idle": 0.5}}
        shipment = Shipment(scored_batch({SEED}), 7, 5, [True, False, True], draws=2, data_position=96, times=times)
        send_shipment(shipment, [trainer])
    else:
        got = recv_shipment(worker, limits=LIMITS)
        assert (got.step, got.version, got.varied, got.draws, got.data_position) == (7, 5, [True, False, True], 2, 96)
        assert got.times == {{"time_generate": 1.5, "time_verify": 0.25, "time_reward": 0.125, "time_idle": 0.5}}
        assert_same_batch(got.scored, scored_batch({SEED}))
        print("shipment arrived whole", flush=True)
    # the trainer pushes its weights (seed 1) as version 8 into the worker's model (seed 2)
    model = tiny_model(seed=1 if ctx.rank == trainer else 2)
    if ctx.rank == trainer:
        send_weights(model, 8, dsts=[worker], src=trainer, bucket_bytes=BUCKET)
    else:
        before = [p.detach().clone() for p in model.parameters()]
        version = recv_weights(model, src=trainer, bucket_bytes=BUCKET)
        want = tiny_model(seed=1)
        assert version == 8
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "precondition: weights moved"
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want.parameters()))
        print("weights arrived whole", flush=True)
    # a header that is not a shipment: the trainer refuses it naming the worker (the worker sends nothing more)
    if ctx.rank == worker:
        dist.send(torch.zeros(HEADER_LEN, dtype=torch.int64), trainer)
    else:
        try:
            recv_shipment(worker, limits=LIMITS)
        except WorkerError as err:
            print(f"refused: {{err}}", flush=True)
    # a push from a model of another shape: the worker refuses it before loading anything
    if ctx.rank == trainer:
        dist.send(torch.tensor([0x7F7A74770001, 9, 1, 123], dtype=torch.int64), worker)
    else:
        try:
            recv_weights(model, src=trainer, bucket_bytes=BUCKET)
        except WeightPushError as err:
            print(f"refused: {{err}}", flush=True)
    distributed.shutdown()
    return 0

sys.exit(distributed.fail_fast(main))
"""


def tiny_model(seed: int):
    from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(build_char_tokenizer(), TinyModelConfig(**TINY), seed=seed)


def test_a_shipment_and_a_weight_push_cross_two_processes_whole(tmp_path):
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_job([*torchrun, "--master-port", str(free_port()), str(script)], env=ENV, timeout=HANG_S)
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-3000:]
    assert "shipment arrived whole" in out and "weights arrived whole" in out
    assert "refused: rollout worker rank 1: malformed batch: not a fasttnt shipment of this version" in out
    assert "refused: rank 0 pushed the weights of another model (1 parameters, signature 0x7b;" in out


def test_a_push_over_a_link_of_its_own_arrives_whole_and_a_mismatched_one_is_refused():
    # two ends in one process (threads) on a gloo link outside torch.distributed's default world: the link a vLLM
    # worker's transfer engine takes pushes on (fasttnt.pipeline.vllm_transfer; through vLLM in test_vllm_real.py)
    bucket_bytes = 4096
    sender, receiver = tiny_model(seed=1), tiny_model(seed=2)
    assert len(layout(sender, bucket_bytes)) >= 3, "the push must take several buckets"
    assert all(Slot.from_list(s.to_list()) == s for b in layout(sender, bucket_bytes) for s in b)
    port, errors = free_port(), []

    def trainer() -> None:
        try:
            group = link("127.0.0.1", port, 0, 2, name="push", timeout=60)
            for version in (5, 6):
                send_weights(sender, version, dsts=[1], src=0, bucket_bytes=bucket_bytes, group=group, timeout=60)
        except Exception as err:  # reported below
            errors.append(err)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    group = link("127.0.0.1", port, 1, 2, name="push", timeout=60)
    before = [p.detach().clone() for p in receiver.parameters()]
    assert recv_weights(receiver, src=0, bucket_bytes=bucket_bytes, group=group, timeout=60) == 5
    moved = any(not torch.equal(a, p) for a, p in zip(before, receiver.parameters(), strict=True))
    assert moved, "precondition: the weights moved"
    assert all(torch.equal(a, b) for a, b in zip(receiver.parameters(), sender.parameters(), strict=True))
    other = tiny_model(seed=2)
    other.model.norm.weight.data = torch.ones(other.model.norm.weight.numel() + 1)  # another shape: another model
    kept = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(WeightPushError, match="pushed the weights of another model"):
        recv_weights(other, src=0, bucket_bytes=bucket_bytes, group=group, timeout=60)
    assert all(torch.equal(a, p) for a, p in zip(kept, other.parameters(), strict=True)), "nothing was loaded"
    assert not errors, errors  # the trainer's thread stays blocked on version 6's buckets until its timeout


# -- a run with a rollout worker (on-policy against the colocated loop, and one step off: tests/test_benchmarks.py's
# test_a_rollout_worker_on_policy_and_one_step_off, through benchmarks/pipeline_overlap.py) -----------------------

# rewards that vary by construction (support/varied.py) and the entropy bonus: every step moves the weights, so a
# worker that sampled from other weights than the trainer's says so in the leading digits
PIPELINE_RUN = [*SMALL, varied.OVERRIDE, "steps=4", "save_every=2", "optim.lr=1e-2", "loss.entropy_coef=0.01"]
PIPELINE_ENV = {**ENV, "PYTHONPATH": varied.PYTHONPATH}


def test_a_push_that_did_not_arrive_stops_a_stale_run(tmp_path):
    # k = 1: the worker loses the push of version 2 (support/lossy_push.py) and samples step 4 with version 1's
    # weights while saying 2. Its batch's log-probs cannot be checked against the trainer's (step 4 trains on version
    # 3), so the push itself is: the worker's log-probs of a probe under version 2 against the trainer's
    out = tmp_path / "worker"
    args = ["train", "--output-dir", str(out), f"cache_dir={warmups(tmp_path)}", *PIPELINE_RUN, "rollout.workers=1",
            "rollout.max_staleness=1", "rollout.max_logp_diff=1e-4"]  # fmt: skip
    result = run_job(launch_command("torchrun", "lossy_push", *args), env=PIPELINE_ENV, timeout=HANG_S)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "step 4: rollout worker rank 1's log-probs of a probe under weight version 2 differ" in result.stderr
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3], "step 4 did not train"
    assert rows[2]["worker_logp_diff"] < 1e-6, "precondition: the push of version 1 arrived whole"


def test_the_roles_a_world_cannot_hold_are_refused_naming_the_key():
    from fasttnt.config import ConfigError, load_config
    from fasttnt.pipeline.roles import PipelineRanks, join

    one = load_config(None, ["rollout.workers=1"])
    assert (PipelineRanks.of(one, 2).trainer_ranks, PipelineRanks.of(one, 2).worker_ranks) == (range(1), range(1, 2))
    two = load_config(None, ["rollout.workers=2", "rollout.prompts_per_step=4"])
    assert (PipelineRanks.of(two, 6).trainer_ranks, PipelineRanks.of(two, 6).worker_ranks) == (range(4), range(4, 6))
    with pytest.raises(ConfigError, match=r"leaves 3 trainers, and 3 trainers x loss.mini_batches=1 do not divide"):
        PipelineRanks.of(two, 5)
    with pytest.raises(ConfigError, match=r"rollout.workers=1 leaves no training rank in a world of 1"):
        PipelineRanks.of(one, 1)
    with pytest.raises(ConfigError, match=r"rollout.workers=3 do not divide rollout.prompts_per_step=4"):
        PipelineRanks.of(load_config(None, ["rollout.workers=3", "rollout.prompts_per_step=4"]), 4)
    if importlib.util.find_spec("vllm") is None:  # the main suite's environment: vLLM is not installed
        with pytest.raises(ConfigError, match=r"rollout.engine=vllm: the rollout workers' engine is not installed"):
            PipelineRanks.of(load_config(None, ["rollout.workers=1", "rollout.engine=vllm"]), 2)
    for overrides, message in [
        (["rollout.max_staleness=1"], "rollout.max_staleness: 1 overlaps generation with training on rollout workers"),
        (["rollout.workers=-1"], "rollout.workers: must be >= 0"),
        (["rollout.workers=1", "rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0"),
        (["rollout.weight_transfer=nccl"], "rollout.weight_transfer: nccl moves the weights to vLLM rollout workers"),
        (["rollout.workers=1", "rollout.weight_transfer=nccl"], "rollout.weight_transfer: nccl moves the weights"),
        (["rollout.workers=1", "rollout.engine=vllm", "rollout.max_staleness=2", "rollout.weight_transfer=nccl"],
         "at rollout.max_staleness <= 1, where each push is taken as it is sent"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, overrides)
    # NCCL between GPUs: a CPU run is refused before anything connects (the launcher's variables, no store behind)
    nccl = load_config(None, ["rollout.workers=1", "rollout.engine=vllm", "rollout.weight_transfer=nccl"])
    launched = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with pytest.MonkeyPatch.context() as env:
        for key, value in launched.items():
            env.setenv(key, value)
        with pytest.raises(ConfigError, match=r"rollout.weight_transfer=nccl moves the weights between GPUs: this run "
                                              r"is on cpu"):  # fmt: skip
            join(nccl, "cpu")


def test_workers_in_one_process_are_refused_before_any_work(tmp_path, capsys):
    from fasttnt.cli import main as cli_main

    code = cli_main(["train", "--output-dir", str(tmp_path / "run"), f"cache_dir={tmp_path / 'cache'}",
                     *PIPELINE_RUN[:-4], "rollout.workers=1"])  # fmt: skip
    assert (
        code == 2
        and "rollout.workers=1: the workers are ranks of their own: launch 2 processes" in capsys.readouterr().err
    )
    assert not (tmp_path / "cache").exists(), "no warm-up was trained"


def test_sigterm_saves_once_and_an_on_policy_resume_reproduces_the_run(tmp_path):
    # torchrun passes SIGTERM to both ranks: the trainer finishes its step and saves, the worker goes on shipping
    # until the launcher ends it; --resume sends the worker the checkpoint's step, data position and weights, so at
    # k = 0 the resumed run logs what an uninterrupted colocated one logs (which a worker on-policy equals:
    # test_benchmarks.py's test_a_rollout_worker_on_policy_and_one_step_off)
    overrides = [*PIPELINE_RUN, "steps=40", "save_every=100"]
    _, straight = train(tmp_path, "straight", *overrides)
    out = tmp_path / "stopped"
    args = ["train", "--output-dir", str(out), f"cache_dir={warmups(tmp_path)}", *overrides, "rollout.workers=1"]
    command = launch_command("torchrun", varied.MODULE, *args)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=PIPELINE_ENV)
    deadline = time.monotonic() + HANG_S
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:  # the first step logged
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode != 0 and "stopped by SIGTERM after step" in stderr, stderr[-3000:]
    done = metric_rows(out)
    assert 1 <= len(done) < 40, "stopped after a step, before the end"
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{len(done):06d}"]
    resumed = run_job([*command, "--resume"], env=PIPELINE_ENV, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    pipeline_only = ("weight_version", "staleness", "worker_")
    rows = [{k: v for k, v in deterministic(r).items() if not k.startswith(pipeline_only)} for r in metric_rows(out)]
    assert rows == [deterministic(r) for r in straight]


# -- faults: each stops the run within a bounded time with one line naming the process at fault (support/faulty.py)

FAULTY_ENV = {**ENV, "PYTHONPATH": varied.PYTHONPATH}


def faulty_args(tmp_path, *extra: str) -> list[str]:
    return ["train", "--output-dir", str(tmp_path / "run"), f"cache_dir={warmups(tmp_path)}", *PIPELINE_RUN,
            "rollout.workers=1", *extra]  # fmt: skip


def test_a_worker_that_dies_stops_every_rank_at_once_naming_it(tmp_path):
    # 2 trainers and 2 workers started by hand (no launcher ends the others when a process is gone: they must), the
    # last worker dying at step 2: each trainer stops with one line naming it (each waits for its batch), and the
    # other worker stops once the trainers are gone
    args = faulty_args(tmp_path, "rollout.workers=2")
    ranks = run_ranks("faulty", *args, env={**FAULTY_ENV, "FAULT": "worker-dies", "FAULT_RANK": "3"}, timeout=HANG_S,
                      world=4)  # fmt: skip
    assert ranks[3].returncode == 9, "precondition: the last worker died"
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1], "precondition: the run trained a step first"
    for trainer in ranks[:2]:
        assert trainer.returncode == 1, trainer.stderr[-3000:]
        lines = [line for line in trainer.stderr.splitlines() if line.startswith("fasttnt train:")]
        assert lines == [lines[0]] and lines[0].startswith(
            "fasttnt train: rollout worker rank 3 is gone: its connection closed while waiting for batch"
        ), trainer.stderr[-3000:]
        assert "Traceback" not in trainer.stderr
    assert ranks[2].returncode == 1 and re.search(r"fasttnt train: rollout worker rank 2: the trainer \(rank \d\) is "
                                                  r"gone", ranks[2].stderr), ranks[2].stderr[-3000:]  # fmt: skip


def test_a_worker_that_hangs_stops_the_trainer_after_the_timeout_naming_it(tmp_path):
    # the worker sleeps instead of shipping step 2's batch; ranks started by hand, the worker killed once the trainer
    # has stopped (a launcher would end it then)
    timeout = 10  # seconds: many times a step of this run, on any machine
    args = faulty_args(tmp_path, f"rollout.worker_timeout={timeout}")
    started = time.monotonic()
    trainer, _ = run_ranks("faulty", *args, env={**FAULTY_ENV, "FAULT": "worker-hangs"}, timeout=HANG_S, until=0)
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1], "precondition: the run trained a step first"
    assert trainer.returncode == 1, trainer.stderr[-3000:]
    hung = rf"rollout worker rank 1 stopped answering: no batch for \d+ s \(rollout.worker_timeout={timeout}\)"
    assert re.search(rf"fasttnt train: {hung}", trainer.stderr), trainer.stderr[-3000:]
    assert time.monotonic() - started >= timeout, "the trainer waited the timeout out"


def test_a_trainer_that_dies_stops_the_worker_naming_it(tmp_path):
    trainer, worker = run_ranks("faulty", *faulty_args(tmp_path), env={**FAULTY_ENV, "FAULT": "trainer-dies"},
                                timeout=HANG_S)  # fmt: skip
    assert trainer.returncode == 9, "precondition: the trainer died"
    assert worker.returncode == 1, worker.stderr[-3000:]
    assert "fasttnt train: rollout worker rank 1: the trainer (rank 0) is gone: its connection closed" in worker.stderr


def test_a_run_killed_one_step_off_resumes_to_what_an_uninterrupted_run_logs(tmp_path):
    # k = 1 and a checkpoint after every step: each keeps the batches in flight (the next step's, sampled from weights
    # the checkpoint no longer holds). The job is killed -9, every rank, while its trainers pause at step 2's push
    # (support/faulty.py), after step 1's checkpoint; --resume continues it from there. 2 trainers (ZeRO-3) and 2
    # workers: each trainer received every worker's batch in flight, each resumes from the one file, and each worker
    # gets its own batches back for its push checks
    ranks = 2
    overrides = [*PIPELINE_RUN, "steps=5", "save_every=1", f"rollout.workers={ranks}", "rollout.max_staleness=1",
                 "distributed.zero_stage=3"]  # fmt: skip

    def command(module: str, out: str) -> list[str]:
        args = ["train", "--output-dir", str(tmp_path / out), f"cache_dir={warmups(tmp_path)}", *overrides]
        return launch_command("torchrun", module, *args, ranks=2 * ranks)

    straight = run_job(command(varied.MODULE, "straight"), env=PIPELINE_ENV, timeout=HANG_S)
    assert straight.returncode == 0, straight.stderr[-3000:]
    paused = tmp_path / "paused"
    env = {**FAULTY_ENV, "FAULT": "trainer-pauses", "FAULT_FILE": str(paused)}
    proc = subprocess.Popen(command("faulty", "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + HANG_S
    while not paused.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_job(proc.pid)
    proc.wait()
    assert paused.exists(), "precondition: the trainer reached step 2's push"
    out = tmp_path / "killed"
    assert [r["step"] for r in metric_rows(out)] == [1]
    (checkpoint,) = list_checkpoints(out / "checkpoints")
    _, (in_flight,), _ = read_in_flight(checkpoint / IN_FLIGHT, workers=ranks)
    assert len(in_flight) == ranks, "each worker's batch"
    assert all((s.step, staleness(s.step, s.version)) == (2, 1) for s in in_flight), "a stale batch was in flight"

    resumed = run_job([*command(varied.MODULE, "killed"), "--resume"], env=PIPELINE_ENV, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, expected = metric_rows(out), metric_rows(tmp_path / "straight")
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1, 1]
    checked = [r.get("worker_logp_diff") for r in rows]
    assert [c is not None for c in checked] == [False, False, True, True, True]
    assert max(checked[2:]) < 1e-6, "the checkpoint's weights were checked as a push, and arrived whole"
    assert [deterministic(r) for r in rows] == [deterministic(r) for r in expected]


def test_one_step_off_the_update_corrects_in_its_own_pass_as_a_separate_old_logprob_pass_did(tmp_path):
    # k = 1 on a worker: the rollout correction (token-truncate, auto at staleness) weighs the worker's log-probs
    # against the trainer's before the update. At one mini-batch and one epoch the update's own first pass is the
    # trainer's, so the fused loss forms the weights in it; support/old_logprob_pass.py runs the separate no-grad
    # pass the trainer ran before. 3 steps each: the same losses and grad norms (float32 rounding: the separate pass's
    # ratios are 1 +- 1e-7, the loss's own exactly 1), and the same weights (the bound of test_distributed's
    # _assert_same_weights: 1e-4 of the distance training moved them)
    from safetensors.torch import load_file
    from support.small import weights_apart

    from fasttnt.config import load_config
    from fasttnt.embedded.tiny import warmup_cache_path

    # a cap of 1 truncates every weight above 1: one step's staleness moves a share of the tokens there
    overrides = [*PIPELINE_RUN, "steps=3", "rollout.workers=1", "rollout.max_staleness=1",
                 "loss.rollout_correction_cap=1.0"]  # fmt: skip
    runs = {}
    for module in (varied.MODULE, "old_logprob_pass"):
        out = tmp_path / module
        args = ["train", "--output-dir", str(out), f"cache_dir={warmups(tmp_path)}", *overrides]
        result = run_job(launch_command("torchrun", module, *args, ranks=2), env=PIPELINE_ENV, timeout=HANG_S)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[module] = metric_rows(out), load_file(out / "final" / "model.safetensors")
    (rows, weights), (before, old_weights) = runs[varied.MODULE], runs["old_logprob_pass"]
    assert [r["staleness"] for r in rows] == [0, 1, 1], "precondition: steps 2 and 3 trained one step off"
    assert max(r["rollout_is_clipped_frac"] for r in before[1:]) > 0, "precondition: the correction truncated"
    for row, want in zip(rows, before, strict=True):
        for key in ("loss", "grad_norm", "clip_frac", "entropy", "reward"):
            assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (row["step"], key)
    cfg = load_config(None, [f"cache_dir={warmups(tmp_path)}", *overrides])  # the runs' warm-up, their start
    start_dir = warmup_cache_path(warmups(tmp_path), cfg.model.tiny, cfg.warmup)
    diff, moved = weights_apart(weights, old_weights, load_file(start_dir / "model.safetensors"))
    assert moved > 0 and diff <= 1e-4 * moved, (diff, moved)


def test_the_curves_of_a_run_with_workers_gain_the_pipelines_row(tmp_path):
    from matplotlib.image import imread

    from fasttnt.plots import plot_curves

    colocated = [{"step": s, "reward": 0.1 * s, "acc": 0.5, "len": 10.0, "non_thinking_ratio": 0.0} for s in (1, 2, 3)]
    pipelined = [{**row, "weight_version": row["step"] - 2, "staleness": 1, "time_wait": 0.1, "worker_time_idle": 0.2,
                  "generated_tokens_per_s": 100.0, "trained_tokens_per_s": 300.0} for row in colocated]  # fmt: skip
    plot_curves(colocated, tmp_path / "colocated.png")
    plot_curves(pipelined, tmp_path / "pipelined.png")
    two_rows, three_rows = (imread(tmp_path / f"{name}.png").shape[0] for name in ("colocated", "pipelined"))
    assert three_rows == pytest.approx(two_rows * 3 / 2, rel=0.01), "a third row of 3.5 inches"


def test_a_mode_mixed_run_one_step_off_with_tnt_and_dynamic_sampling_trains_on_a_worker(tmp_path):
    # k = 1 with forced rows in both modes under the mixture rule: the worker adds each row's first-token log-prob
    # and its group's pi(</think> | x) under the weights that sampled it (modes.behaviour_logprobs), which the
    # mixture and the fade read (tests/test_modes.py works the weights by hand). TNT's reward (its per-query limits
    # from each group's thinking rows, computed where the batch is scored: the worker) and DAPO's dynamic sampling
    # (the worker draws, the trainer chooses the groups, as the colocated loop) run on the stale batches too
    mixed = ["rollout.forced_non_thinking=0.25", "rollout.forced_thinking=0.25", "loss.mode_token_logp=mixture"]
    args = ["train", "--output-dir", str(tmp_path / "run"), f"cache_dir={warmups(tmp_path)}", *PIPELINE_RUN, *mixed,
            "reward.scheme=tnt", "rollout.dynamic_sampling=true", "rollout.max_draws=2", "rollout.workers=1",
            "rollout.max_staleness=1"]  # fmt: skip
    result = run_job(launch_command("torchrun", varied.MODULE, *args), env=PIPELINE_ENV, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows)
    assert any(abs(r["rollout_is_mean"] - 1.0) > 1e-4 for r in rows[1:]), "precondition: the batches were stale"
    limits = [r["limit_mean"] for r in rows[1:] if "limit_mean" in r]
    assert limits, "precondition: a stale batch's groups had thinking rows, so TNT set their limits"
    assert all(math.isfinite(x) and x > 0 for x in limits)
    assert all(1 <= r["draws"] <= 2 and 0 < r["varied_group_frac"] <= 1 for r in rows), rows  # the worker's draws


def test_a_worker_ahead_of_a_slow_trainer_never_samples_past_the_bound(tmp_path):
    # k = 2 and a trainer that sleeps before every push (support/faulty.py): the worker, free of its own work, waits
    # for the oldest version each step may use and takes no other, so step t trains on version max(0, t - 3)
    args = faulty_args(tmp_path, "steps=6", "rollout.max_staleness=2")
    result = run_job(launch_command("torchrun", "faulty", *args), env={**FAULTY_ENV, "FAULT": "trainer-slow"},
                     timeout=HANG_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert [r["weight_version"] for r in rows] == [0, 0, 0, 1, 2, 3]
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2, 2]
    waited, slept = sum(r["time_wait"] for r in rows[3:]), sum(r["time_sync"] for r in rows[3:])
    assert waited < slept, "precondition: the worker was ahead of the trainer (its batch ready before it was due)"


def test_a_signal_to_the_worker_alone_stops_both_after_one_checkpoint(tmp_path):
    # ranks started by hand, the worker alone gets SIGTERM after shipping step 1: its step 2 batch says so, the
    # trainer trains step 2, saves and exits 3, and the worker, asked to stop, exits 3 when the trainer is gone
    trainer, worker = run_ranks("faulty", *faulty_args(tmp_path), env={**FAULTY_ENV, "FAULT": "worker-signalled"},
                                timeout=HANG_S)  # fmt: skip
    assert trainer.returncode == 3, trainer.stderr[-3000:]
    assert "fasttnt train: stopped by a signal to another rank after step 2" in trainer.stderr
    assert worker.returncode == 3, worker.stderr[-3000:]
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1, 2]
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000002"]
