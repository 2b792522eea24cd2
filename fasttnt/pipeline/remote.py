"""The two ends of a run whose rollouts come from workers of their own (``rollout.workers``; the roles and the link
between them: ``fasttnt.pipeline.roles``): the trainers' side (``RemoteRollouts``: each step's shipment received and
checked, the weights pushed back after the update) and the worker's loop (``serve``).

The protocol, one worker or more and one trainer or more (each role in a world of its own): at the start trainer 0
(``TRAINER``) sends the step and data position it starts from, and the weights (version = that step; under ZeRO-3
the trainers gather each bucket together and trainer 0 sends it); then for each step t the worker waits until it
holds a version no older than t - 1 - k (``staleness.oldest_version``), runs the step's rollouts
(``fasttnt.rollouts.Rollouts``, the colocated loop's own code) and ships them to every trainer, which trains on its
share of the groups as the colocated ranks share a step's prompts (``trainer_share``); the trainers push version t,
without waiting for the worker to take it (the sends run in the background while the trainers go on to receive the
next step's batch; over NCCL, which has no timeout, the push waits until the workers take it: ``push``). They push
only the versions a later step needs, so every push is taken. At k = 0 the worker generates step t + 1 with the
weights step t made: the colocated loop's samples, on another process, and the stale-weight guard compares the
batch's log-probs with the trainer's as for vLLM. At k >= 1 the batch was sampled from older weights than the
trainers hold, so the guard checks each push instead: the trainers compute the log-probs of a probe (the first group
of the step whose update made the version) under the version they push, the worker computes them once it took that
version and ships them with its next batch, and the guard's rule (``rollout.max_logp_diff``) stops the run where
they differ: a push that did not arrive, or was garbled, stops it at any k.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from .. import distributed
from ..checkpoint import ResumeError, load_tensors
from ..config import TrainConfig
from ..dynamic_sampling import choose_groups, concat_draws, select_groups
from ..engines.batch import RolloutBatch
from ..guard import StaleWeightsError, stale_weights
from ..preemption import EXIT_PREEMPTED, StopSignals
from ..rollouts import StepRollouts
from ..scoring import ScoredBatch
from .peer import PeerLostError, recv_from, send_to, trainer_name, worker_name
from .roles import TRAINER, Pipeline, join
from .staleness import check_fresh, oldest_version
from .vllm_transfer import BACKEND, NCCL_BACKEND
from .weights import layout, recv_weights, send_weights
from .wire import Limits, Shipment, WorkerError, decode, encode, recv_shipment, send_shipment

IN_FLIGHT = "in_flight.pt"  # a checkpoint's file at rollout.max_staleness >= 1 (RemoteRollouts.in_flight)
# IN_FLIGHT's layout (in_flight_file): 2 stores a checksum with every batch and probe; a file of an earlier format has
# none to check, and is refused
IN_FLIGHT_FORMAT = 2
# a run whose model names no position limit, and that sets no data.max_prompt_tokens, takes prompts of any length: a
# million tokens a row still bounds what a garbled shipment header can make a trainer allocate (shipment_limits)
NO_BUDGET_PROMPT_TOKENS = 1 << 20


def probe_rows(batch: RolloutBatch) -> RolloutBatch:
    """The rows whose log-probs check a push: the batch's first group."""
    return batch.group_slice(0, 1)


def trainer_share(drawn: ScoredBatch, varied: list[bool], groups: list[int], filled: int, draws: int, *, rank: int,
                  trainers: int) -> StepRollouts:  # fmt: skip
    """Trainer ``rank``'s part of a step's rollouts among ``trainers``, as the colocated ranks share a step: the
    ``rank``-th of ``trainers`` equal runs of the groups trained on (``groups``, ascending: all of ``drawn``'s without
    dynamic sampling, so that each trainer has the prompts the colocated rank of its number draws), and, for the
    logged metrics that the trainers sum or gather, the same part of the drawn groups and their ``varied`` flags. The
    verifier's counts, of whole draws, stay with trainer 0. One trainer: the whole step."""
    if trainers == 1:
        trained = drawn if len(groups) == len(varied) else select_groups(drawn, groups)
        return StepRollouts(drawn, trained, varied, filled, draws)
    per_drawn, per_trained = len(varied) // trainers, len(groups) // trainers
    mine = list(range(rank * per_drawn, (rank + 1) * per_drawn))
    share = select_groups(drawn, mine)
    if rank == 0:
        share.judged = replace(share.judged, timeouts=drawn.judged.timeouts, crashes=drawn.judged.crashes)
    chosen = groups[rank * per_trained : (rank + 1) * per_trained]
    trained = share if chosen == mine else select_groups(drawn, chosen)
    # where there are fills, every varied group was chosen (dynamic_sampling.choose_groups): the others are the fills
    fills = sum(not varied[g] for g in chosen) if filled else 0
    return StepRollouts(share, trained, [varied[g] for g in mine], fills, draws)


def whole_step(shipments: list[Shipment]) -> Shipment:
    """The workers' shipments of one step as one, in the workers' order (as the colocated ranks' shares of a step):
    the version the oldest was sampled with, the slowest worker's seconds per phase, and whether any was asked to
    stop. The workers draw in step, so their draws and data positions agree."""
    if len(shipments) == 1:
        return shipments[0]
    first = shipments[0]
    times = {name: max(s.times[name] for s in shipments) for name in first.times}
    return Shipment(concat_draws([s.scored for s in shipments]), first.step, min(s.version for s in shipments),
                    [v for s in shipments for v in s.varied], first.draws, first.data_position, times,
                    stop=any(s.stop for s in shipments))  # fmt: skip


def shipment_limits(cfg: TrainConfig, model: torch.nn.Module, prompt_budget: int | None) -> Limits:
    """What a shipment of this run may hold (``wire.Limits``): the responses of a worker's share of a step's prompts
    in each draw the step may take; a row's prompt, and its response, within the positions the run gives a sequence
    (``prompt_budget``, the longest prompt it takes: ``run_setup.prompt_budget_of``, + rollout.max_new_tokens, the
    engines' max_model_len: a response is its pre-fill, a few tokens, and at most max_new_tokens sampled); token ids
    within ``model``'s embedding."""
    r = cfg.rollout
    draws = r.max_draws if r.dynamic_sampling else 1
    prompt = NO_BUDGET_PROMPT_TOKENS if prompt_budget is None else prompt_budget
    return Limits(rows=r.prompts_per_step // r.workers * r.group_size * draws, row_tokens=prompt + r.max_new_tokens,
                  vocab=model.get_input_embeddings().num_embeddings)  # fmt: skip


def checksum(*tensors: torch.Tensor) -> str:
    """The SHA-256 of ``tensors``' dtypes, shapes and bytes, in order (``in_flight_file``)."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# Each stored batch is its message (header, payload: ``wire.encode``) and the checksum of both, the header holding the
# step, the version, the draws, the data position and every field's dtype and size, the payload every field: the
# checksum covers exactly what is read back. Each probe entry is its version's probes and the checksum of the version
# with them. Per batch rather than one checksum of the file, so that a mismatch names the batch, and the file stays
# what checkpoint.write_trainer_files' torch.save writes: a flipped bit in a tensor, or in the pickled structure that
# says which bytes make a tensor, changes what a checksum covers; one in the rest of the file (the zip's records, the
# keys, the format) fails the load or the layout's checks (read_in_flight), or leaves the content as it was written.
def in_flight_file(last: list[Shipment], queue: Iterable[list[Shipment]], probes: dict[int, list[torch.Tensor]]
                   ) -> dict[str, object]:  # fmt: skip
    """What ``IN_FLIGHT`` holds (``torch.save``'s object): the shipments of the step trained last (``last``) and of
    the steps in flight (``queue``), one per worker, and the probes not checked yet, each with its checksum."""

    def stored(shipment: Shipment) -> tuple[torch.Tensor, torch.Tensor, str]:
        header, payload = encode(shipment)
        return header, payload, checksum(header, payload)

    return {
        "format": IN_FLIGHT_FORMAT,
        "last": [stored(s) for s in last],
        "queue": [[stored(s) for s in step] for step in queue],
        "probes": {v: (list(p), checksum(torch.tensor([v]), *p)) for v, p in probes.items()},
    }


def read_in_flight(path: Path, *, workers: int, device: torch.device | str = "cpu"
                   ) -> tuple[list[Shipment], list[list[Shipment]], dict[int, list[torch.Tensor]]]:  # fmt: skip
    """``in_flight_file``'s ``last``, ``queue`` and ``probes`` read back from ``path`` onto ``device``, of a run with
    ``workers`` rollout workers: a file that cannot be read, lacks a key, holds another layout or other workers'
    batches, or whose content does not match its checksums is a ``ResumeError`` naming it and what is wrong."""
    saved = load_tensors(path, map_location="cpu")  # checked here, on the host, then moved

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ResumeError(f"--resume: {path}: {what}")

    need(isinstance(saved, dict), f"holds a {type(saved).__name__}, not the dict of a checkpoint's batches in flight")
    version = saved.get("format")
    need(version == IN_FLIGHT_FORMAT, f"format {version}, not {IN_FLIGHT_FORMAT}: written before its batches carried "
         "checksums (no format) or by another version of fasttnt, or damaged")  # fmt: skip
    for key in ("last", "queue", "probes"):
        need(key in saved, f"key {key!r} missing")
    need(len(saved) == 4, f"keys {sorted(map(str, saved))}, not format, last, queue and probes")

    def read(messages, where: str) -> list[Shipment]:
        need(isinstance(messages, list), f"{where} is a {type(messages).__name__}, not a list of batches")
        if len(messages) != workers:
            raise ResumeError(f"--resume: {path} holds the batches of {len(messages)} rollout workers, and this run "
                              f"has rollout.workers={workers}: resume with as many")  # fmt: skip
        shipments = []
        for i, message in enumerate(messages):
            at = f"{where}[{i}]"
            need(isinstance(message, tuple) and len(message) == 3, f"batch {at} is not a (header, payload, checksum)")
            header, payload, digest = message
            need(isinstance(header, torch.Tensor) and isinstance(payload, torch.Tensor) and isinstance(digest, str),
                 f"batch {at} is not a (header, payload, checksum)")  # fmt: skip
            need(checksum(header, payload) == digest, f"batch {at} does not match its checksum: the file is damaged")
            # no limits: the batch was held against them when it arrived, and its checksum says it is as it was
            shipments.append(decode(header, payload, worker=f"{path} batch {at}", limits=None, device=device))
        return shipments

    last = read(saved["last"], "last")
    need(isinstance(saved["queue"], list), "queue is not a list of steps")
    queue = [read(messages, f"queue[{i}]") for i, messages in enumerate(saved["queue"])]
    need(isinstance(saved["probes"], dict), "probes is not a dict of weight versions")
    probes = {}
    for v, entry in saved["probes"].items():
        ok = isinstance(v, int) and 0 <= v < 2**63 and isinstance(entry, tuple) and len(entry) == 2
        need(ok and isinstance(entry[0], list) and all(isinstance(p, torch.Tensor) for p in entry[0]),
             f"probes[{v!r}] is not a weight version's (probes, checksum)")  # fmt: skip
        need(len(entry[0]) == workers, f"probes[{v}] holds {len(entry[0])} probes, not one per rollout worker")
        need(checksum(torch.tensor([v]), *entry[0]) == entry[1], f"probes[{v}] do not match their checksum: the file "
             "is damaged")  # fmt: skip
        probes[v] = [p.to(device) for p in entry[0]]
    return last, queue, probes


def checks_pushes(cfg: TrainConfig) -> bool:
    """Whether each weight push is checked by a probe's log-probs on both sides (module docstring): at k >= 1, with
    the stale-weight guard on."""
    return cfg.rollout.max_staleness > 0 and cfg.rollout.max_logp_diff is not None


class RemoteRollouts:
    """A trainer's side: ``step`` is ``Rollouts.step``'s, from the workers' shipments. Every trainer receives each
    worker's shipment whole (its metrics, probes and checkpoints are the same on each) and trains on its share of the
    step (``trainer_share``); trainer 0 speaks for them where one voice is enough (the starting point)."""

    def __init__(self, cfg: TrainConfig, pipeline: Pipeline, device: torch.device, resumed_from: Path | None) -> None:
        """``resumed_from``: the checkpoint a resumed run continues, whose batches in flight (``IN_FLIGHT``) this
        trains on first."""
        self.cfg, self.pipeline, self.ranks, self.device = cfg, pipeline, pipeline.ranks, device
        self.link = pipeline.link
        self.rank, self.trainers = pipeline.rank, len(pipeline.ranks.trainers)  # the trainers' ranks come first
        self.workers = list(pipeline.ranks.worker_ranks)
        self.push_link = None  # the weights': the pipeline's link, or the vLLM workers' own (made at start)
        self.nccl = None  # rollout.weight_transfer=nccl, on trainer 0: vLLM's PyNcclCommunicator to the workers
        self.model: torch.nn.Module | None = None
        self.limits: Limits | None = None  # what a shipment may hold, once the model is known (start)
        self.deferred: int | None = None  # nccl at k = 1: the version pushed once the next batch is in (push)
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_bytes
        self.timeout = cfg.rollout.worker_timeout
        self.pending: list = []  # the sends of the pushes still in flight
        self.last: list[Shipment] = []  # the shipments of the step trained last, one per worker
        self.shipped: Shipment | None = None  # the same, as one (``whole_step``): what the trainer logs
        self.queue: deque[list[Shipment]] = deque()  # shipments received ahead of their step (in_flight)
        self.logp_diff: float | None = None  # the last push check's mean |difference| per token (the worst worker's)
        self.stop_requested = False  # a worker was asked to stop (a signal to it alone): the trainers stop too
        # k >= 1: each push checked by its probes (module docstring): version -> per worker, the trainer's log-probs of
        # that worker's probe
        self.probes: dict[int, list[torch.Tensor]] = {}
        self.check_pushes = checks_pushes(cfg)
        if resumed_from is not None and cfg.rollout.max_staleness > 0:
            self._restore(resumed_from / IN_FLIGHT)

    def start(self, model: torch.nn.Module, step: int, data_position: int) -> None:
        """The workers' starting point: the step they generate from and their data position there, the weights, and
        a resumed run's shipments (the last trained and those in flight, whose first groups each worker's push
        checks read: each worker gets its own)."""
        from ..run_setup import prompt_budget_of

        first = step + len(self.queue)  # the workers generate step first + 1 on
        position = self.queue[-1][0].data_position if self.queue else data_position
        back = [self.last, *self.queue] if self.last else []
        self.push_link = self.link
        if self.cfg.rollout.engine == "vllm":
            # a vLLM worker takes the weights through its transfer engine, on a link of its own (roles.weights_link)
            # that it joins once its engine is built, which it says on this link first: a worker that dies building
            # it is seen at once here, where a link's rendezvous would wait out the timeout
            for worker in self.workers:
                recv_from(torch.empty(1, dtype=torch.int64), worker, peer=worker_name(worker),
                          what="its vLLM engine", timeout=self.timeout, group=self.link)  # fmt: skip
            nccl_port = self._nccl_port() if self.cfg.rollout.weight_transfer == "nccl" else None
            self.push_link = self.pipeline.weights_link()
            if nccl_port is not None:  # the workers' engines join it once on the weights link (vllm_transfer)
                from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

                self.nccl = stateless_init_process_group(self.pipeline.address[0], nccl_port, 0,
                                                         1 + len(self.workers), self.device)  # fmt: skip
        self.model = model
        self.limits = shipment_limits(self.cfg, model, prompt_budget_of(self.cfg))
        if self.rank == TRAINER:
            for worker in self.workers:
                send_to(torch.tensor([first, position, len(back)], dtype=torch.int64), worker,
                        peer=worker_name(worker), what="the run's starting point to be taken", timeout=self.timeout,
                        group=self.link)  # fmt: skip
        send_weights(model, step, dsts=self.workers, src=TRAINER, bucket_bytes=self.bucket_bytes,
                     timeout=self.timeout, group=self.push_link, nccl=self.nccl)  # fmt: skip
        if self.rank == TRAINER:
            for shipments in back:
                for worker, shipment in zip(self.workers, shipments, strict=True):
                    send_shipment(shipment, [worker], group=self.link, timeout=self.timeout, peer=worker_name(worker))

    def _nccl_port(self) -> int | None:
        """Trainer 0: the port of the NCCL group's store on its host (the group: it, rank 0, and the workers), sent
        to the workers before they build their transfer engines; the other trainers: None (not in the group)."""
        if self.rank != TRAINER:
            return None
        port = distributed.free_port()
        for worker in self.workers:
            send_to(torch.tensor([port], dtype=torch.int64), worker, peer=worker_name(worker),
                    what="the NCCL group's port to be taken", timeout=self.timeout, group=self.link)  # fmt: skip
        return port

    def step(self, step: int, clock) -> StepRollouts:
        """Step ``step``'s rollouts as the workers shipped them (``clock`` laps ``wait``), checked against the step
        and the staleness bound; the groups trained on chosen as the colocated loop chooses them (each worker's
        quota from its own draws, as each colocated rank's), this trainer's share (``trainer_share``)."""
        shipments = self.queue.popleft() if self.queue else self._receive(step)
        clock.lap("wait")
        if self.deferred is not None:  # the workers took this batch's predecessor's version: now they take the next
            self._send(self.deferred)
            self.deferred = None
            clock.lap("sync")  # the push's seconds where the trainer logs its pushes (time_sync)
        self.last, self.shipped, self.logp_diff = shipments, whole_step(shipments), None
        self.stop_requested |= self.shipped.stop
        if any(s.probe_version >= 0 for s in shipments):
            self._check_push(step, shipments)
        groups, filled, offset = [], 0, 0  # the groups trained on, in the joined batch's numbering
        for shipment in shipments:
            mine, fills = list(range(len(shipment.varied))), 0
            if self.cfg.rollout.dynamic_sampling:
                mine, fills = choose_groups(shipment.varied, self.cfg.rollout.prompts_per_step // len(self.workers))
            groups += [offset + g for g in mine]
            filled += fills
            offset += len(shipment.varied)
        whole = self.shipped
        return trainer_share(whole.scored, whole.varied, groups, filled, whole.draws, rank=self.rank,
                             trainers=self.trainers)  # fmt: skip

    def _receive(self, step: int) -> list[Shipment]:
        """Each worker's next shipment, which must be step ``step``'s, sampled within the staleness bound."""
        shipments = []
        for worker in self.workers:
            name = worker_name(worker)
            shipment = recv_shipment(worker, group=self.link, limits=self.limits, device=self.device,
                                     timeout=self.timeout)  # fmt: skip
            if shipment.step != step:
                raise WorkerError(f"{name} shipped step {shipment.step}'s batch where step {step}'s was due")
            check_fresh(step, shipment.version, self.cfg.rollout.max_staleness, worker=name)
            shipments.append(shipment)
        return shipments

    def in_flight(self, step: int) -> dict[str, object] | None:
        """What a checkpoint after step ``step`` keeps of the pipeline (its ``extra`` files), so that a resume logs
        what an uninterrupted run logs: at k >= 1, the next k steps' batches (received now: the workers sampled them
        from weights the checkpoint no longer holds), the shipments of step ``step`` and the probes of the pushes not
        checked yet. At k = 0 nothing is in flight between steps: None."""
        k = self.cfg.rollout.max_staleness
        if k == 0:
            return None
        while len(self.queue) < k and step + len(self.queue) < self.cfg.steps:
            self.queue.append(self._receive(step + len(self.queue) + 1))
        return {IN_FLIGHT: in_flight_file(self.last, self.queue, self.probes)}

    def _restore(self, path: Path) -> None:
        """``in_flight``'s file, read back (written by a run with as many workers: the config check said so)."""
        if not path.is_file():
            raise ResumeError(f"--resume: {path} is missing: a checkpoint at rollout.max_staleness >= 1 keeps the "
                              "batches in flight there")  # fmt: skip
        self.last, queue, self.probes = read_in_flight(path, workers=len(self.workers), device=self.device)
        self.queue.extend(queue)

    def _check_push(self, step: int, shipments: list[Shipment]) -> None:
        """Each worker's log-probs of a version's probe against the trainer's (``StaleWeightsError`` past the guard's
        limit)."""
        v, limit = max(s.probe_version for s in shipments), self.cfg.rollout.max_logp_diff
        names = [worker_name(worker) for worker in self.workers]
        for name, shipment in zip(names, shipments, strict=True):  # every worker took the version, and checked it
            if shipment.probe_version != v:
                raise WorkerError(f"{name} checked weight version {shipment.probe_version} where another worker "
                                  f"checked version {v}")  # fmt: skip
        if not self.check_pushes or v not in self.probes:
            raise WorkerError(f"{names[0]} checked weight version {v}, which was not pushed with a probe")
        diffs = []
        for name, shipment, mine in zip(names, shipments, self.probes.pop(v), strict=True):
            theirs = shipment.probe_logp
            if theirs.numel() != mine.numel():
                raise WorkerError(f"{name}: malformed batch: {theirs.numel()} probe log-probs, not {mine.numel()}")
            # both sides run the trainer's own forward (fasttnt.policy.response_logprobs) on the same rows and weights
            diffs.append(float((mine.double() - theirs.to(mine.device).double()).abs().mean()))
            if stale_weights(diffs[-1], limit):
                raise StaleWeightsError(
                    f"step {step}: {name}'s log-probs of a probe under weight version {v} differ from the trainer's "
                    f"by {diffs[-1]:.3g} per token, past rollout.max_logp_diff={limit}: the push did not arrive "
                    "whole; not training on its batches"
                )
        self.logp_diff = max(diffs)

    def push(self, model: torch.nn.Module, step: int, logprobs) -> None:
        """Version ``step`` (the weights after step ``step``'s update) to the workers, if a later step needs it, in
        the background; every trainer calls it (ZeRO-3's gathers, and the probe's forward, are collective). Earlier
        pushes may still be in flight: at k >= 2 the worker takes a version only when a step it generates needs it,
        k - 1 steps after it was pushed, and until then it is sending batches that the trainers take after this push,
        so waiting here for the previous push would deadlock (each push in flight holds a copy of the weights on the
        host). At k >= 1 ``logprobs(rows)`` gives the trainer's log-probs of ``rows`` under it, for each worker's
        probe (``probe_rows`` of its shipment of step ``step``) that the worker's will be checked against."""
        self.pending = [work for work in self.pending if not work.done()]
        if step <= self.cfg.steps - 1 - self.cfg.rollout.max_staleness:
            if self.check_pushes:
                self.probes[step] = [logprobs(probe_rows(shipment.scored.batch)) for shipment in self.last]
            if self.cfg.rollout.weight_transfer == "nccl" and self.cfg.rollout.max_staleness == 1:
                # NCCL has no timeout: broadcast only once the workers are taking it, after they shipped the next
                # batch, which is when a worker one step off takes this version (step)
                self.deferred = step
            else:
                self._send(step)

    def _send(self, version: int) -> None:
        """Version ``version`` to the workers: in the background over gloo, at once over NCCL (``send_weights``)."""
        self.pending += send_weights(self.model, version, dsts=self.workers, src=TRAINER, group=self.push_link,
                                     bucket_bytes=self.bucket_bytes, wait=False, timeout=self.timeout,
                                     nccl=self.nccl)  # fmt: skip

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []


def serve(cfg: TrainConfig, out: Path, *, resume: bool) -> int:
    """A rollout worker's process: build what a rollout needs, then generate each step's batch with weights no more
    than ``rollout.max_staleness`` versions old and ship it to the trainer, until the run's last step."""
    del out, resume  # the trainer owns the run's files and says where it starts
    # SIGTERM or SIGINT (a launcher passes them to every rank; a scheduler may send one to this rank alone): the
    # worker keeps shipping, and says so with its next batch, while the trainer finishes its step, saves and exits
    with StopSignals() as signals:
        return _serve(cfg, signals)


def _serve(cfg: TrainConfig, signals: StopSignals) -> int:
    from .. import run_setup
    from ..data import dataset_style, think_end_token_id
    from ..engines import build_engine
    from ..modes import ModeMix, behaviour_logprobs
    from ..policy import PolicyHead
    from ..rollouts import Rollouts
    from ..stream import ProblemStream
    from ..trainer import PhaseClock
    from ..verify import VerifierPool

    device_type = run_setup.device_type_of(cfg)
    pipeline = join(cfg, device_type)
    device = distributed.local_device(device_type)
    pipeline.barrier("the trainer's model")  # the trainer loads it first (the tiny model's warm-up fills the cache)
    link = pipeline.link
    model, tokenizer, model_path = run_setup.load_policy(cfg, device)
    model.to(device).eval()
    prompt_budget = run_setup.prompt_budget_of(cfg)
    settings = run_setup.engine_settings(cfg, model_path, device, prompt_budget)
    bucket_bytes = cfg.rollout.weight_sync_bucket_bytes
    trainer, timeout = trainer_name(TRAINER), cfg.rollout.worker_timeout
    if cfg.rollout.engine == "vllm":  # the pushes through vLLM's weight-transfer calls (pipeline.vllm_transfer)
        # no sleep mode: the worker's device holds no trainer to give its memory to
        nccl = cfg.rollout.weight_transfer == "nccl"
        backend = NCCL_BACKEND if nccl else BACKEND
        settings = replace(settings, weight_transfer=backend, sleep_between_rollouts=False)
        engine = build_engine("vllm", model, tokenizer, settings)
        for rank in pipeline.ranks.trainers:
            send_to(torch.ones(1, dtype=torch.int64), rank, peer=trainer_name(rank),
                    what="the engine's news to be taken", timeout=timeout, group=link)  # fmt: skip
        init = pipeline.weights_init(layout(model, bucket_bytes))
        if nccl:  # the NCCL group's store: on trainer 0's host, its port chosen there
            port = torch.empty(1, dtype=torch.int64)
            recv_from(port, TRAINER, peer=trainer, what="the NCCL group's port", timeout=timeout, group=link)
            workers = pipeline.ranks.worker_ranks
            init.update(nccl_port=int(port), nccl_rank=1 + workers.index(pipeline.rank), nccl_world=1 + len(workers))
        # the Hugging Face copy takes every push too where something reads it: the push checks and the behaviour
        # log-probs run on it (at k >= 1), and vLLM's log-probs are held against it (_check_engine)
        copy = cfg.rollout.max_staleness > 0 and (checks_pushes(cfg) or ModeMix.of(cfg) is not None)
        engine.join_trainer(init, also_into=model if copy else None)
        receive = engine.receive_weights
    else:
        engine = build_engine(cfg.rollout.engine, model, tokenizer, settings)

        def receive() -> int:
            return recv_weights(model, src=TRAINER, bucket_bytes=bucket_bytes, timeout=timeout, group=link)

    stream = ProblemStream(cfg)
    run_setup.drop_long_prompts(stream, cfg, tokenizer, prompt_budget)
    start = torch.empty(3, dtype=torch.int64)
    recv_from(start, TRAINER, peer=trainer, what="the run's starting point", timeout=timeout, group=link)
    first, data_position, n_back = start.tolist()
    stream.seek(data_position)
    version = receive()
    # a resumed run's last trained shipment and those in flight (RemoteRollouts.start): what this worker had shipped
    limits = shipment_limits(cfg, model, prompt_budget)
    back = [recv_shipment(TRAINER, group=link, limits=limits, device=device, timeout=timeout, peer=trainer)
            for _ in range(n_back)]  # fmt: skip
    verifier = VerifierPool(cfg.verify_workers, cfg.verify_timeout)
    think_end_id, mode_mix = think_end_token_id(tokenizer), ModeMix.of(cfg)
    # the workers share each draw's prompts as the colocated ranks do, over their own world (roles.join)
    workers = pipeline.ranks.worker_ranks
    me = distributed.DistContext(workers.index(pipeline.rank), len(workers), int(os.environ.get("LOCAL_RANK", "0")),
                                 device) if len(workers) > 1 else None  # fmt: skip
    rollouts = Rollouts(
        cfg, engine=engine, stream=stream, tokenizer=tokenizer,
        prompt=lambda p: run_setup.training_prompt(cfg, tokenizer, p), think_end_id=think_end_id,
        markers=dataset_style(cfg.data.train, markers=cfg.data.hack_markers).markers, mode_mix=mode_mix,
        verifier=verifier, dist=me, rank=me.rank if me else 0,
        prompts_per_rank=cfg.rollout.prompts_per_step // len(workers),
    )  # fmt: skip
    check_pushes = checks_pushes(cfg)
    # mode-mixed at k >= 1: the mixture and the fade read the sampling weights' log-probs (modes.behaviour_logprobs)
    behaviour = cfg.rollout.max_staleness > 0 and mode_mix is not None
    # the trainer's own packed forward, for the probes and the behaviour log-probs
    head = PolicyHead(model) if check_pushes or behaviour else None
    # a vLLM worker at k >= 1: the push check holds its Hugging Face copy against the trainer, and this holds vLLM's
    # log-probs of its samples against the copy's (both took the same push), so that vLLM's load is checked too
    engine_check = check_pushes and cfg.rollout.engine == "vllm" and cfg.rollout.top_p == 1.0
    # step -> its batch, until the version its update makes is checked
    shipped: dict[int, RolloutBatch] = {s.step: s.scored.batch for s in back} if check_pushes else {}
    probe_version, probe_logp = -1, None
    if version in shipped:  # resumed at k >= 1: the checkpoint's weights are a version taken like any push
        probe_version, probe_logp = version, _probe_logprobs(cfg, head, probe_rows(shipped.pop(version)))
    idle = 0.0  # seconds waiting since the last batch was generated: for weights, and for the trainer to take it
    try:
        for step in range(first + 1, cfg.steps + 1):
            while version < oldest_version(step, cfg.rollout.max_staleness):
                waited = time.perf_counter()
                version = receive()
                idle += time.perf_counter() - waited
                if check_pushes:  # the push check (module docstring): this version's log-probs of its probe
                    probe_version, probe_logp = version, _probe_logprobs(cfg, head, probe_rows(shipped.pop(version)))
            clock = PhaseClock()
            rolled = rollouts.step(step, clock)
            if engine_check:
                _check_engine(cfg, head, rolled.drawn.batch, version, skip_first=mode_mix is not None)
            if behaviour:  # part of the batch's generation: under the weights that sampled it
                behaviour_logprobs(rolled.drawn.batch, think_end_id, lambda rows: _probe_logprobs(cfg, head, rows))
                clock.lap("generate")
            shipment = Shipment(rolled.drawn, step, version, rolled.varied, rolled.draws, stream.position,
                                {**clock.times, "time_idle": idle}, probe_version, probe_logp,
                                stop=signals.requested is not None)  # fmt: skip
            waited = time.perf_counter()
            send_shipment(shipment, pipeline.ranks.trainers, group=link, timeout=timeout)
            idle = time.perf_counter() - waited
            probe_version, probe_logp = -1, None
            if check_pushes:
                shipped[step] = rolled.drawn.batch
    except PeerLostError:
        if signals.requested is None:
            raise
        return EXIT_PREEMPTED  # asked to stop: the trainer did, after its checkpoint
    finally:
        verifier.close()
        engine.close()
    distributed.shutdown()  # its own world
    return 0


def _check_engine(cfg: TrainConfig, head: torch.nn.Module, batch: RolloutBatch, version: int, *, skip_first: bool
                  ) -> None:  # fmt: skip
    """A vLLM worker's log-probs of its samples (the batch's first group) against its Hugging Face copy's under the
    same weight version, by the guard's rule (``StaleWeightsError`` past ``rollout.max_logp_diff``). ``skip_first``
    (mode-mixed rollouts): each response's first token is left out, as the guard leaves it out (pre-filled, or drawn
    from the renormalised distribution)."""
    rows = probe_rows(batch)
    copy = _probe_logprobs(cfg, head, rows).double()
    keep = torch.ones_like(copy, dtype=torch.bool)
    if skip_first:
        keep[rows.cu_seqlens[:-1].to(keep.device)] = False
    diff = float((copy - rows.rollout_logp.to(copy.device).double())[keep].abs().mean())
    limit = cfg.rollout.max_logp_diff
    if stale_weights(diff, limit):
        raise StaleWeightsError(
            f"vLLM's log-probs of its samples differ from its Hugging Face copy's under weight version {version} by "
            f"{diff:.3g} per token, past rollout.max_logp_diff={limit}: vLLM did not load the push whole"
        )


def _probe_logprobs(cfg: TrainConfig, head: torch.nn.Module, probe: RolloutBatch) -> torch.Tensor:
    """The log-probs (n,) of ``probe``'s response tokens under ``head`` (the worker model's ``PolicyHead``), through
    the pass the trainer's ``Actor.logprobs`` runs (``no_grad_logprobs``), so that equal weights give equal numbers."""
    from ..policy import no_grad_logprobs, plan_micro_batches
    from ..run_setup import bf16_autocast

    device = next(head.parameters()).device
    plan = plan_micro_batches(probe, cfg.micro_batch_tokens)
    return no_grad_logprobs(head, probe, plan, temperature=cfg.rollout.temperature, bf16=bf16_autocast(cfg, device))
