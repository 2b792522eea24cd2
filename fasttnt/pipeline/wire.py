"""A scored batch between processes: what a rollout worker hands a trainer, with the step it is for and the version
of the weights it was sampled with, over torch.distributed's point-to-point ``send`` / ``recv``.

A message is two sends: a header (int64: a magic number, the step, the weight version, the draws, the data position,
the probe's version, whether the worker was asked to stop, the number of fields, then each field's dtype code and
element count, ``MESSAGE_FIELDS`` in order) and one uint8 payload holding every present field's bytes back to back,
each padded to 8 bytes so that every field can be viewed in place as its dtype. The receiver checks the header's
sizes against what a shipment of the run may hold (``Limits``) before it allocates the payload, then the fields'
shapes against each other, the token ids against the vocabulary and the rewards for being finite before it builds the
batch: a malformed message is a ``WorkerError`` that names the worker and the field, never a batch trained on.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fasttnt_kernels import TntRewards

from ..engines.batch import RolloutBatch
from ..scoring import Judged, ScoredBatch
from .peer import PipelineError, isend, padding, recv_from, trainer_name, wait_for, worker_name

MAGIC = 0x7F7A_7471_0004  # "fasttnt", wire format 4
# (name, dtype) of every field, in message order; a field may be absent (code 0) where the batch has none
FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("prompt_lengths", torch.int64),  # (S,)
    ("prompt_tokens", torch.int64),  # (sum of prompt_lengths,)
    ("response_ids", torch.int64),  # (N,)
    ("cu_seqlens", torch.int64),  # (S+1,)
    ("truncated", torch.bool),  # (S,)
    ("rollout_logp", torch.float32),  # (N,) or absent
    ("forced", torch.int8),  # (S,) or absent
    ("text_lengths", torch.int64),  # (S,) bytes of each decoded text (UTF-8)
    ("text_bytes", torch.uint8),  # (sum of text_lengths,)
    ("correct", torch.bool),  # (S,)
    ("counts", torch.int64),  # (3,) group size, verifier timeouts, verifier crashes
    ("rewards", torch.float32),  # (S,)
    ("non_thinking", torch.bool),  # (S,)
    ("solution_len", torch.int32),  # (S,)
    ("limit", torch.float32),  # (G,)
    ("hacked", torch.bool),  # (S,) or absent
    ("levels", torch.int64),  # (S,) or absent
    ("behaviour_first_logp", torch.float32),  # (S,) or absent
    ("behaviour_think_end_logp", torch.float32),  # (S,) or absent
)
OPTIONAL = frozenset({"rollout_logp", "forced", "hacked", "levels", "behaviour_first_logp", "behaviour_think_end_logp"})
# what a step's rollouts add to its drawn batch: per drawn group whether its rewards differ, the worker's seconds per
# phase (TIMED), and the log-probs of a probe under the last version the worker took (``remote``'s push check)
META_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("varied", torch.bool),
    ("times", torch.float64),
    ("probe_logp", torch.float32),
)
MESSAGE_FIELDS = FIELDS + META_FIELDS
# the worker's seconds generating, verifying and rewarding the batch, and idle before it: waiting for weights, and for
# the trainer to take its previous batch
TIMED = ("generate", "verify", "reward", "idle")
DTYPE_CODES = {torch.int64: 1, torch.float32: 2, torch.bool: 3, torch.int8: 4, torch.int32: 5, torch.uint8: 6,
               torch.float64: 7}  # fmt: skip
HEADER_INTS = 8  # before the fields' codes and counts
HEADER_LEN = HEADER_INTS + 2 * len(MESSAGE_FIELDS)
# the fields of one element per token of a row (prompt_tokens: of its prompt; probe_logp: of the probe's responses)
PER_TOKEN = frozenset({"prompt_tokens", "response_ids", "rollout_logp", "probe_logp"})
FIXED_SIZE = {"counts": 3, "times": len(TIMED)}
# a token decodes to its vocabulary entry's bytes, a byte that is not UTF-8 to U+FFFD (3 bytes): the longest entry of
# Qwen's vocabulary is 128 bytes (384 at worst decoded), so 1 KiB per response token bounds text_bytes with room
MAX_TOKEN_BYTES = 1024


class WorkerError(PipelineError):
    """A rollout worker sent what cannot be trained on (a malformed batch)."""


@dataclass(frozen=True)
class Limits:
    """What a shipment of a run may hold (``remote.shipment_limits``). Each field's element count in the header is
    held against these before the payload is allocated (``most_elements``): a garbled count is refused, never
    allocated; the token ids are held against ``vocab`` once the payload is in."""

    rows: int  # responses: a worker's prompts per draw x rollout.group_size x the draws a step may take
    row_tokens: int  # tokens of a row's prompt, and of its response: the longest prompt + rollout.max_new_tokens
    vocab: int  # token ids lie in [0, vocab): the model's embedding rows


@dataclass
class Shipment:
    """A step's rollouts as a worker ships them: every response drawn (``scored``), the training step they are for,
    the version of the weights that sampled them (the trainer's weights after that many optimizer steps), per drawn
    group whether its rewards differ, the draws, the worker's data position after them, and its seconds per phase
    (``TIMED``)."""

    scored: ScoredBatch
    step: int
    version: int
    varied: list[bool]
    draws: int = 1
    data_position: int = 0
    times: dict[str, float] | None = None
    # the log-probs (n,) of the probe rows of step probe_version's batch under weight version probe_version, computed
    # by the worker once it took that version (-1, None: no version taken since the last shipment)
    probe_version: int = -1
    probe_logp: torch.Tensor | None = None
    stop: bool = False  # the worker was asked to stop (SIGTERM or SIGINT): the trainer stops after this step


def to_fields(scored: ScoredBatch) -> dict[str, torch.Tensor | None]:
    """The batch's tensors by ``FIELDS`` name, on the CPU (a wire of gloo's), None where absent."""
    batch, judged, r = scored.batch, scored.judged, scored.rewards
    texts = [t.encode() for t in judged.texts]
    fields = {
        "prompt_lengths": torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.int64),
        "prompt_tokens": torch.tensor([t for p in batch.prompt_ids for t in p], dtype=torch.int64),
        "response_ids": batch.response_ids,
        "cu_seqlens": batch.cu_seqlens,
        "truncated": batch.truncated,
        "rollout_logp": batch.rollout_logp,
        "forced": batch.forced,
        "text_lengths": torch.tensor([len(t) for t in texts], dtype=torch.int64),
        "text_bytes": torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8) if any(texts) else None,
        "correct": judged.correct,
        "counts": torch.tensor([batch.group_size, judged.timeouts, judged.crashes], dtype=torch.int64),
        "rewards": r.rewards,
        "non_thinking": r.non_thinking,
        "solution_len": r.solution_len,
        "limit": r.limit,
        "hacked": scored.hacked,
        "levels": scored.levels,
        "behaviour_first_logp": batch.behaviour_first_logp,
        "behaviour_think_end_logp": batch.behaviour_think_end_logp,
    }
    if fields["text_bytes"] is None:
        fields["text_bytes"] = torch.zeros(0, dtype=torch.uint8)
    out = {}
    for name, dtype in FIELDS:
        t = fields[name]
        out[name] = None if t is None else t.detach().to("cpu", dtype).contiguous().reshape(-1)
    return out


def from_fields(
    fields: dict[str, torch.Tensor | None], *, worker: str, vocab: int | None, device: torch.device | str = "cpu"
):
    """The ``ScoredBatch`` of ``fields`` (``to_fields``' inverse) on ``device``, after checking that the fields agree
    with each other, that every token id lies in [0, ``vocab``) (None: a batch checked when it arrived, read back
    unchanged from a checkpoint) and that the rewards are finite (``WorkerError`` naming ``worker`` otherwise)."""
    missing = [name for name, _ in FIELDS if fields.get(name) is None and name not in OPTIONAL]
    if missing:
        raise WorkerError(f"{worker}: malformed batch: fields {missing} missing")
    cu, counts = fields["cu_seqlens"], fields["counts"]
    s = cu.numel() - 1
    _check(s >= 0, worker, "cu_seqlens is empty")
    _check(counts.numel() == FIXED_SIZE["counts"], worker, f"counts holds {counts.numel()} numbers, not "
           f"{FIXED_SIZE['counts']} (group size, verifier timeouts, verifier crashes)")  # fmt: skip
    group_size, timeouts, crashes = (int(x) for x in counts.tolist())
    _check(group_size >= 1 and s % group_size == 0, worker, f"{s} responses are not groups of {group_size}")
    bounds = cu.tolist()
    n = fields["response_ids"].numel()
    _check(bounds[0] == 0 and bounds[-1] == n and all(a <= b for a, b in itertools.pairwise(bounds)),
           worker, f"cu_seqlens does not bound {n} response tokens")  # fmt: skip
    per_sequence = ("prompt_lengths", "truncated", "forced", "text_lengths", "correct", "rewards", "non_thinking",
                    "solution_len", "hacked", "levels", "behaviour_first_logp", "behaviour_think_end_logp")  # fmt: skip
    for name in per_sequence:
        t = fields.get(name)
        _check(t is None or t.numel() == s, worker, f"{name} holds {None if t is None else t.numel()}, not {s}")
    logp = fields.get("rollout_logp")
    _check(logp is None or logp.numel() == n, worker, f"rollout_logp holds {logp.numel() if logp is not None else 0}")
    _check(fields["limit"].numel() == s // group_size, worker, f"limit holds {fields['limit'].numel()} groups")
    prompt_lengths, text_lengths = fields["prompt_lengths"].tolist(), fields["text_lengths"].tolist()
    _check(sum(prompt_lengths) == fields["prompt_tokens"].numel() and min(prompt_lengths, default=0) >= 0, worker,
           "prompt_lengths do not add up to prompt_tokens")  # fmt: skip
    _check(sum(text_lengths) == fields["text_bytes"].numel() and min(text_lengths, default=0) >= 0, worker,
           "text_lengths do not add up to text_bytes")  # fmt: skip
    if vocab is not None:  # an id outside the vocabulary would index past the embedding (a device-side assert on CUDA)
        _check_ids(fields["prompt_tokens"], [0, *itertools.accumulate(prompt_lengths)], "prompt_tokens", vocab, worker)
        _check_ids(fields["response_ids"], bounds, "response_ids", vocab, worker)
    # a NaN or infinite reward would turn every advantage of its group, and so the whole loss, into NaN
    row = _first(~torch.isfinite(fields["rewards"]))
    if row is not None:
        raise _malformed(worker, f"rewards holds {fields['rewards'][row].item()} (row {row}), not a finite number")
    tokens, raw = fields["prompt_tokens"].tolist(), bytes(fields["text_bytes"].numpy())
    prompts, texts, p, t = [], [], 0, 0
    for pl, tl in zip(prompt_lengths, text_lengths, strict=True):
        prompts.append(tokens[p : p + pl])
        texts.append(raw[t : t + tl].decode(errors="replace"))
        p, t = p + pl, t + tl

    def on(name: str) -> torch.Tensor | None:
        value = fields.get(name)
        return None if value is None else value.to(device)

    batch = RolloutBatch(prompts, on("response_ids"), on("cu_seqlens"), on("truncated"), group_size,
                         rollout_logp=on("rollout_logp"), forced=on("forced"),
                         behaviour_first_logp=on("behaviour_first_logp"),
                         behaviour_think_end_logp=on("behaviour_think_end_logp"))  # fmt: skip
    responses = fields["response_ids"].tolist()
    batch._with_host_copies(bounds, [responses[a:b] for a, b in itertools.pairwise(bounds)])
    rewards = TntRewards(on("rewards"), on("non_thinking"), on("solution_len"), on("limit"))
    judged = Judged(texts, on("correct"), timeouts=timeouts, crashes=crashes)
    return ScoredBatch(batch, judged, rewards, hacked=on("hacked"), levels=on("levels"))


def _check(ok: bool, worker: str, what: str) -> None:
    if not ok:
        raise _malformed(worker, what)


def _malformed(worker: str, what: str) -> WorkerError:
    return WorkerError(f"{worker}: malformed batch: {what}")


def _first(mask: torch.Tensor) -> int | None:
    """The index of ``mask``'s first True, None where there is none."""
    hits = mask.nonzero()
    return int(hits[0]) if hits.numel() else None


def _check_ids(ids: torch.Tensor, bounds: list[int], name: str, vocab: int, worker: str) -> None:
    """Every id of ``ids`` (rows between ``bounds``) in [0, ``vocab``), else a ``WorkerError`` naming the first row
    holding one outside."""
    at = _first((ids < 0) | (ids >= vocab))
    if at is not None:
        row = bisect.bisect_right(bounds, at) - 1
        raise _malformed(worker, f"{name} holds token id {ids[at].item()} (row {row}), outside the vocabulary "
                                 f"[0, {vocab})")  # fmt: skip


def encode(shipment: Shipment) -> tuple[torch.Tensor, torch.Tensor]:
    """``shipment`` as its message: the header (int64, ``HEADER_LEN``) and the payload (uint8)."""
    fields = to_fields(shipment.scored)
    fields["varied"] = torch.tensor(shipment.varied, dtype=torch.bool)
    times = shipment.times or {}
    fields["times"] = torch.tensor([times.get(f"time_{phase}", 0.0) for phase in TIMED], dtype=torch.float64)
    probe = shipment.probe_logp
    fields["probe_logp"] = None if probe is None else probe.detach().to("cpu", torch.float32).reshape(-1)
    header = [MAGIC, shipment.step, shipment.version, shipment.draws, shipment.data_position, shipment.probe_version,
              int(shipment.stop), len(MESSAGE_FIELDS)]  # fmt: skip
    parts = []
    for name, dtype in MESSAGE_FIELDS:
        t = fields[name]
        header += [0, 0] if t is None else [DTYPE_CODES[dtype], t.numel()]
        if t is not None:
            raw = t.view(torch.uint8)
            parts += [raw, torch.zeros(padding(raw.numel()), dtype=torch.uint8)]
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return torch.tensor(header, dtype=torch.int64), payload


def most_elements(limits: Limits, response_tokens: int) -> dict[str, int]:
    """The most elements each field of a shipment within ``limits`` holds, its response_ids holding
    ``response_tokens``: one per response (or fewer: per group) but for the bounds of the responses (one more), the
    per-token fields (``PER_TOKEN``: at most ``row_tokens`` a row), the text (``MAX_TOKEN_BYTES`` a response token)
    and the fields of a fixed size."""
    most = dict.fromkeys((name for name, _ in MESSAGE_FIELDS), limits.rows)
    most["cu_seqlens"] = limits.rows + 1
    most.update(dict.fromkeys(PER_TOKEN, limits.rows * limits.row_tokens))
    most["text_bytes"] = min(response_tokens, most["response_ids"]) * MAX_TOKEN_BYTES
    return {**most, **FIXED_SIZE}


def payload_layout(header: torch.Tensor, *, worker: str, limits: Limits | None) -> tuple[list[tuple], int]:
    """Where each field lies in the payload a header announces: ``(name, dtype or None, offset, count)`` per field,
    and the payload's size in bytes (``WorkerError`` where the header is not one of ``encode``'s, or announces more
    than ``limits`` allow: checked before the payload is allocated; None: a checkpoint's batch, in memory already)."""
    magic, *_, n_fields = header[:HEADER_INTS].tolist()
    if header.numel() != HEADER_LEN or magic != MAGIC or n_fields != len(MESSAGE_FIELDS):
        raise WorkerError(f"{worker}: malformed batch: not a fasttnt shipment of this version (magic {magic:#x})")
    spec = header[HEADER_INTS:].tolist()
    codes = {code: dtype for dtype, code in DTYPE_CODES.items()}
    names = [name for name, _ in MESSAGE_FIELDS]
    most = {} if limits is None else most_elements(limits, spec[2 * names.index("response_ids") + 1])
    layout, size = [], 0
    for (name, dtype), code, numel in zip(MESSAGE_FIELDS, spec[0::2], spec[1::2], strict=True):
        if code == 0:
            layout.append((name, None, 0, 0))
            continue
        if codes.get(code) != dtype or numel < 0:
            raise WorkerError(f"{worker}: malformed batch: field {name} has dtype code {code}, count {numel}")
        if limits is not None and numel > most[name]:
            raise WorkerError(f"{worker}: malformed batch: field {name} announces {numel} elements, more than the "
                              f"{most[name]} a shipment of this run holds (at most {limits.rows} responses of "
                              f"{limits.row_tokens} tokens)")  # fmt: skip
        nbytes = numel * dtype.itemsize
        layout.append((name, dtype, size, numel))
        size += nbytes + padding(nbytes)
    return layout, size


def decode(
    header: torch.Tensor,
    payload: torch.Tensor,
    *,
    worker: str,
    limits: Limits | None,
    device: torch.device | str = "cpu",
) -> Shipment:
    """``encode``'s inverse, checked (``WorkerError`` naming ``worker``: malformed), on ``device``. ``limits``: what
    the shipment may hold; None for a batch read back from a checkpoint, which was checked when it arrived (and whose
    checksum says it is unchanged: ``remote.read_in_flight``)."""
    layout, size = payload_layout(header, worker=worker, limits=limits)
    if payload.numel() != size:
        raise WorkerError(f"{worker}: malformed batch: a payload of {payload.numel()} bytes where {size} are due")
    _, step, version, draws, data_position, probe_version, stop, _ = header[:HEADER_INTS].tolist()
    fields = {}
    for name, dtype, at, numel in layout:
        fields[name] = None if dtype is None else payload[at : at + numel * dtype.itemsize].view(dtype).clone()
    scored = from_fields(fields, worker=worker, vocab=None if limits is None else limits.vocab, device=device)
    groups = scored.batch.lengths.numel() // scored.batch.group_size
    varied, times = fields.get("varied"), fields.get("times")
    if varied is None or varied.numel() != groups or times is None or times.numel() != len(TIMED) or draws < 1:
        raise WorkerError(f"{worker}: malformed batch: its varied flags, times or draws do not fit {groups} groups")
    times = {f"time_{phase}": t for phase, t in zip(TIMED, times.tolist(), strict=True)}
    probe = fields.get("probe_logp")
    if (probe is None) != (probe_version < 0):
        raise WorkerError(f"{worker}: malformed batch: probe version {probe_version} without its log-probs, or back")
    probe = None if probe is None else probe.to(device)
    return Shipment(scored, step, version, varied.tolist(), draws, data_position, times, probe_version, probe,
                    bool(stop))  # fmt: skip


def send_shipment(
    shipment: Shipment, dsts: Sequence[int], group=None, *, timeout: float | None = None, peer: str | None = None
) -> None:
    """Send ``shipment`` to each of ranks ``dsts`` (``recv_shipment`` there; encoded once, sent to all at once), each
    part taken within ``timeout`` seconds (``peer.wait_for``); ``peer`` names the receiver in errors (by default the
    trainer of its rank, which batches go to)."""
    header, payload = encode(shipment)
    what = f"step {shipment.step}'s batch to be taken"
    sent = []
    for dst in dsts:
        name = peer or trainer_name(dst)
        sent += [(isend(part, dst, peer=name, what=what, group=group), name) for part in (header, payload)]
    for work, name in sent:
        wait_for(work, peer=name, what=what, timeout=timeout)


def recv_shipment(
    src: int,
    group=None,
    *,
    limits: Limits,
    device: torch.device | str = "cpu",
    timeout: float | None = None,
    peer: str | None = None,
) -> Shipment:
    """The shipment rank ``src`` sends (``send_shipment``), checked against ``limits`` and itself (``WorkerError``:
    malformed) and on ``device``; each part within ``timeout`` seconds (``peer.wait_for``); ``peer`` names rank
    ``src`` in errors (by default a rollout worker, which batches come from)."""
    worker = peer or worker_name(src)
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    recv_from(header, src, peer=worker, what="batch", timeout=timeout, group=group)
    _, size = payload_layout(header, worker=worker, limits=limits)  # before anything the header sizes is allocated
    payload = torch.empty(size, dtype=torch.uint8)
    recv_from(payload, src, peer=worker, what="batch", timeout=timeout, group=group)
    return decode(header, payload, worker=worker, limits=limits, device=device)
