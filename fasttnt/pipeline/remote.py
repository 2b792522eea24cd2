"""The trainers' side of a run whose rollouts come from workers of their own (``rollout.workers``; the roles and the
link between them: ``fasttnt.pipeline.roles``; the worker's loop: ``fasttnt.pipeline.worker``): ``RemoteRollouts``,
each step's shipment received and checked, the weights pushed back after the update.

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
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import ResumeError, load_tensors
from ..config import TrainConfig
from ..dynamic_sampling import choose_groups, concat_draws, select_groups
from ..rollouts import Provenance, StepRollouts
from ..run_setup import prompt_budget_of
from ..scoring import ScoredBatch
from .peer import send_to, worker_name
from .push import WeightPush
from .roles import TRAINER, Pipeline
from .staleness import check_fresh, staleness
from .wire import Limits, Shipment, WorkerError, decode, encode, recv_shipment, send_shipment

IN_FLIGHT = "in_flight.pt"  # a checkpoint's file at rollout.max_staleness >= 1 (RemoteRollouts.in_flight)
# IN_FLIGHT's layout (in_flight_file): 2 stores a checksum with every batch and probe; a file of an earlier format has
# none to check, and is refused
IN_FLIGHT_FORMAT = 2
# a run whose model names no position limit, and that sets no data.max_prompt_tokens, takes prompts of any length: a
# million tokens a row still bounds what a garbled shipment header can make a trainer allocate (shipment_limits)
NO_BUDGET_PROMPT_TOKENS = 1 << 20


def trainer_share(drawn: ScoredBatch, varied: list[bool], groups: list[int], filled: int, draws: int,
                  provenance: Provenance, *, rank: int, trainers: int) -> StepRollouts:  # fmt: skip
    """Trainer ``rank``'s part of a step's rollouts among ``trainers``, as the colocated ranks share a step: the
    ``rank``-th of ``trainers`` equal runs of the groups trained on (``groups``, ascending: all of ``drawn``'s without
    dynamic sampling, so that each trainer has the prompts the colocated rank of its number draws), and, for the
    logged metrics that the trainers sum or gather, the same part of the drawn groups and their ``varied`` flags. The
    verifier's counts, of whole draws, stay with trainer 0. One trainer: the whole step."""
    if trainers == 1:
        trained = drawn if len(groups) == len(varied) else select_groups(drawn, groups)
        return StepRollouts(drawn, trained, varied, filled, draws, provenance)
    per_drawn, per_trained = len(varied) // trainers, len(groups) // trainers
    mine = list(range(rank * per_drawn, (rank + 1) * per_drawn))
    share = select_groups(drawn, mine)
    if rank == 0:
        share.judged = replace(share.judged, timeouts=drawn.judged.timeouts, crashes=drawn.judged.crashes)
    chosen = groups[rank * per_trained : (rank + 1) * per_trained]
    trained = share if chosen == mine else select_groups(drawn, chosen)
    # where there are fills, every varied group was chosen (dynamic_sampling.choose_groups): the others are the fills
    fills = sum(not varied[g] for g in chosen) if filled else 0
    return StepRollouts(share, trained, [varied[g] for g in mine], fills, draws, provenance)


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


class RemoteRollouts:
    """A trainer's side: ``step`` is ``Rollouts.step``'s, from the workers' shipments, with their provenance. Every
    trainer receives each worker's shipment whole (its metrics, probes and checkpoints are the same on each) and trains
    on its share of the step (``trainer_share``); trainer 0 speaks for them where one voice is enough (the starting
    point). The weights go back through ``push`` (``WeightPush``), which takes each step's shipments as they arrive
    (a deferred push released, a push check held)."""

    def __init__(self, cfg: TrainConfig, pipeline: Pipeline, device: torch.device, resumed_from: Path | None,
                 push: WeightPush) -> None:  # fmt: skip
        """``resumed_from``: the checkpoint a resumed run continues, whose batches in flight (``IN_FLIGHT``) this
        trains on first."""
        self.cfg, self.pipeline, self.device, self.push = cfg, pipeline, device, push
        self.link = pipeline.link
        self.rank = pipeline.rank  # the trainers' ranks come first
        self.trainer_count = len(pipeline.ranks.trainer_ranks)
        self.worker_ranks = list(pipeline.ranks.worker_ranks)
        self.timeout = cfg.rollout.worker_timeout
        self.limits: Limits | None = None  # what a shipment may hold, once the model is known (start)
        self.queue: deque[list[Shipment]] = deque()  # shipments received ahead of their step (in_flight)
        if resumed_from is not None and cfg.rollout.max_staleness > 0:
            self._restore(resumed_from / IN_FLIGHT)

    def start(self, model: torch.nn.Module, step: int, data_position: int) -> None:
        """The workers' starting point: the step they generate from and their data position there, the weights, and
        a resumed run's shipments (the last trained and those in flight, whose first groups each worker's push
        checks read: each worker gets its own)."""
        first = step + len(self.queue)  # the workers generate step first + 1 on
        position = self.queue[-1][0].data_position if self.queue else data_position
        back = [self.push.last, *self.queue] if self.push.last else []
        self.push.connect(model)
        self.limits = shipment_limits(self.cfg, model, prompt_budget_of(self.cfg))
        if self.rank == TRAINER:
            for worker in self.worker_ranks:
                send_to(torch.tensor([first, position, len(back)], dtype=torch.int64), worker,
                        peer=worker_name(worker), what="the run's starting point to be taken", timeout=self.timeout,
                        group=self.link)  # fmt: skip
        self.push.first(step)
        if self.rank == TRAINER:
            for shipments in back:
                for worker, shipment in zip(self.worker_ranks, shipments, strict=True):
                    send_shipment(shipment, [worker], group=self.link, timeout=self.timeout, peer=worker_name(worker))

    def step(self, step: int, clock) -> StepRollouts:
        """Step ``step``'s rollouts as the workers shipped them (``clock`` laps ``wait``), checked against the step
        and the staleness bound; the groups trained on chosen as the colocated loop chooses them (each worker's
        quota from its own draws, as each colocated rank's), this trainer's share (``trainer_share``), and where they
        come from (``Provenance``: the workers' data position, weight version and seconds)."""
        shipments = self.queue.popleft() if self.queue else self._receive(step)
        clock.lap("wait")
        if self.push.release():  # the workers took this batch's predecessor's version: now they take the next
            clock.lap("sync")  # the push's seconds where the trainer logs its pushes (time_sync)
        logp_diff = self.push.took(step, shipments)
        whole = whole_step(shipments)
        groups, filled, offset = [], 0, 0  # the groups trained on, in the joined batch's numbering
        for shipment in shipments:
            mine, fills = list(range(len(shipment.varied))), 0
            if self.cfg.rollout.dynamic_sampling:
                mine, fills = choose_groups(
                    shipment.varied, self.cfg.rollout.prompts_per_step // len(self.worker_ranks)
                )
            groups += [offset + g for g in mine]
            filled += fills
            offset += len(shipment.varied)
        logged = {"weight_version": whole.version, "staleness": staleness(step, whole.version),
                  **{f"worker_{name}": seconds for name, seconds in whole.times.items()}}  # fmt: skip
        if logp_diff is not None:  # a push checked this step (k >= 1)
            logged["worker_logp_diff"] = logp_diff
        provenance = Provenance(data_position=whole.data_position, generate_seconds=whole.times["time_generate"],
                                stop=whole.stop, logged=logged)  # fmt: skip
        return trainer_share(whole.scored, whole.varied, groups, filled, whole.draws, provenance, rank=self.rank,
                             trainers=self.trainer_count)  # fmt: skip

    def _receive(self, step: int) -> list[Shipment]:
        """Each worker's next shipment, which must be step ``step``'s, sampled within the staleness bound."""
        shipments = []
        for worker in self.worker_ranks:
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
        return {IN_FLIGHT: in_flight_file(self.push.last, self.queue, self.push.probes)}

    def _restore(self, path: Path) -> None:
        """``in_flight``'s file, read back (written by a run with as many workers: the config check said so)."""
        if not path.is_file():
            raise ResumeError(f"--resume: {path} is missing: a checkpoint at rollout.max_staleness >= 1 keeps the "
                              "batches in flight there")  # fmt: skip
        self.push.last, queue, self.push.probes = read_in_flight(
            path, workers=len(self.worker_ranks), device=self.device
        )
        self.queue.extend(queue)


def connect(cfg: TrainConfig, parts, state, probe_logprobs) -> tuple[RemoteRollouts, WeightPush]:
    """A trainer's rollouts from the workers and its pushes to them, started from ``state`` (``parts``: the built
    run, ``fasttnt.run_setup.RunParts``; ``probe_logprobs``: ``WeightPush``'s)."""
    push = WeightPush(cfg, parts.pipeline, parts.device, probe_logprobs)
    rollouts = RemoteRollouts(cfg, parts.pipeline, parts.device, parts.resumed_from, push)
    rollouts.start(parts.model, state.step, state.data_position)
    return rollouts, push
