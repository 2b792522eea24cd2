"""The trainers' weights to the rollout workers: ``WeightPush`` keeps the workers' engines in step with the trainers
(``sync(model, step)``: a push over gloo in the background, or over NCCL once the workers are taking it) and checks
each push at k >= 1 by a probe's log-probs on both sides (``fasttnt.pipeline.remote``'s docstring), the stale-weight
guard's statistic and rule (``guard.mean_logp_diff``, ``guard.stale_weights``) at ``rollout.max_logp_diff``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import distributed
from ..config import TrainConfig
from ..engines.batch import RolloutBatch
from ..guard import StaleWeightsError, mean_logp_diff, stale_weights
from .peer import recv_from, send_to, worker_name
from .roles import TRAINER, Pipeline
from .weights import send_weights
from .wire import Shipment, WorkerError


def probe_rows(batch: RolloutBatch) -> RolloutBatch:
    """The rows whose log-probs check a push: the batch's first group."""
    return batch.group_slice(0, 1)


def checks_pushes(cfg: TrainConfig) -> bool:
    """Whether each weight push is checked by a probe's log-probs on both sides: at k >= 1, with the stale-weight
    guard on."""
    return cfg.rollout.max_staleness > 0 and cfg.rollout.max_logp_diff is not None


class WeightPush:
    """A trainer's pushes of its weights to the workers (every trainer calls each method: ZeRO-3's gathers, and the
    probe's forward, are collective; trainer 0 sends). ``probe_logprobs(rows)``: the trainer's log-probs of ``rows``
    under its current weights (``Actor.logprobs``), for the push check."""

    def __init__(self, cfg: TrainConfig, pipeline: Pipeline, device: torch.device,
                 probe_logprobs: Callable[[RolloutBatch], torch.Tensor] | None = None) -> None:  # fmt: skip
        self.cfg, self.pipeline, self.device, self.probe_logprobs = cfg, pipeline, device, probe_logprobs
        self.link, self.rank = pipeline.link, pipeline.rank
        self.worker_ranks = list(pipeline.ranks.worker_ranks)
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_bytes
        self.timeout = cfg.rollout.worker_timeout
        self.push_link = None  # the weights': the pipeline's link, or the vLLM workers' own (connect)
        self.nccl = None  # rollout.weight_transfer=nccl, on trainer 0: vLLM's PyNcclCommunicator to the workers
        self.model: torch.nn.Module | None = None
        self.deferred: int | None = None  # nccl at k = 1: the version pushed once the next batch is in (sync)
        self.pending: list = []  # the sends of the pushes still in flight
        self.checks = checks_pushes(cfg)
        # k >= 1: version -> per worker, the trainer's log-probs of that worker's probe under that version
        self.probes: dict[int, list[torch.Tensor]] = {}
        self.last: list[Shipment] = []  # the shipments of the step trained last, whose probes the next push takes

    def connect(self, model: torch.nn.Module) -> None:
        """The link the pushes take: the pipeline's, or a vLLM worker's transfer engine's own (``roles.weights_link``),
        which the worker joins once its engine is built and says so on the pipeline's link first (a worker that dies
        building it is seen at once here, where a link's rendezvous would wait out the timeout); with
        ``rollout.weight_transfer=nccl``, the NCCL group too."""
        self.model, self.push_link = model, self.link
        if self.cfg.rollout.engine != "vllm":
            return
        for worker in self.worker_ranks:
            recv_from(torch.empty(1, dtype=torch.int64), worker, peer=worker_name(worker), what="its vLLM engine",
                      timeout=self.timeout, group=self.link)  # fmt: skip
        nccl_port = self._nccl_port() if self.cfg.rollout.weight_transfer == "nccl" else None
        self.push_link = self.pipeline.weights_link()
        if nccl_port is not None:  # the workers' engines join it once on the weights link (vllm_transfer)
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

            self.nccl = stateless_init_process_group(self.pipeline.address[0], nccl_port, 0, 1 + len(self.worker_ranks),
                                                     self.device)  # fmt: skip

    def _nccl_port(self) -> int | None:
        """Trainer 0: the port of the NCCL group's store on its host (the group: it, rank 0, and the workers), sent
        to the workers before they build their transfer engines; the other trainers: None (not in the group)."""
        if self.rank != TRAINER:
            return None
        port = distributed.free_port()
        for worker in self.worker_ranks:
            send_to(torch.tensor([port], dtype=torch.int64), worker, peer=worker_name(worker),
                    what="the NCCL group's port to be taken", timeout=self.timeout, group=self.link)  # fmt: skip
        return port

    def first(self, step: int) -> None:
        """The weights the workers start from, as version ``step``, taken before anything else."""
        send_weights(self.model, step, dsts=self.worker_ranks, src=TRAINER, bucket_bytes=self.bucket_bytes,
                     timeout=self.timeout, group=self.push_link, nccl=self.nccl)  # fmt: skip

    def sync(self, model: torch.nn.Module, step: int) -> None:
        """Version ``step`` (the weights after step ``step``'s update) to the workers, if a later step needs it, in
        the background. Earlier pushes may still be in flight: at k >= 2 the worker takes a version only when a step
        it generates needs it, k - 1 steps after it was pushed, and until then it is sending batches that the
        trainers take after this push, so waiting here for the previous push would deadlock (each push in flight
        holds a copy of the weights on the host). At k >= 1 the trainer's log-probs of each worker's probe
        (``probe_rows`` of its shipment of step ``step``) under it, which the worker's will be checked against."""
        del model  # the one connected: the sends read it in the background
        self.pending = [work for work in self.pending if not work.done()]
        if step > self.cfg.steps - 1 - self.cfg.rollout.max_staleness:
            return
        if self.checks:
            self.probes[step] = [self.probe_logprobs(probe_rows(shipment.scored.batch)) for shipment in self.last]
        if self.cfg.rollout.weight_transfer == "nccl" and self.cfg.rollout.max_staleness == 1:
            # NCCL has no timeout: broadcast only once the workers are taking it, after they shipped the next
            # batch, which is when a worker one step off takes this version (step)
            self.deferred = step
        else:
            self._send(step)

    def release(self) -> bool:
        """The deferred push (NCCL at k = 1), sent now that the workers shipped the next batch and are taking it;
        whether there was one."""
        if self.deferred is None:
            return False
        self._send(self.deferred)
        self.deferred = None
        return True

    def took(self, step: int, shipments: list[Shipment]) -> float | None:
        """Step ``step``'s shipments are in: a push they checked is held against the trainer's probe; returns the
        check's mean |difference| of log-probs per token (the worst worker's), None where no push was checked."""
        self.last = shipments
        if all(s.probe_version < 0 for s in shipments):
            return None
        return self._check(step, shipments)

    def _check(self, step: int, shipments: list[Shipment]) -> float:
        """Each worker's log-probs of a version's probe against the trainer's (``StaleWeightsError`` past the guard's
        limit)."""
        v, limit = max(s.probe_version for s in shipments), self.cfg.rollout.max_logp_diff
        names = [worker_name(worker) for worker in self.worker_ranks]
        for name, shipment in zip(names, shipments, strict=True):  # every worker took the version, and checked it
            if shipment.probe_version != v:
                raise WorkerError(f"{name} checked weight version {shipment.probe_version} where another worker "
                                  f"checked version {v}")  # fmt: skip
        if not self.checks or v not in self.probes:
            raise WorkerError(f"{names[0]} checked weight version {v}, which was not pushed with a probe")
        diffs = []
        for name, shipment, mine in zip(names, shipments, self.probes.pop(v), strict=True):
            theirs = shipment.probe_logp
            if theirs.numel() != mine.numel():
                raise WorkerError(f"{name}: malformed batch: {theirs.numel()} probe log-probs, not {mine.numel()}")
            # both sides run the trainer's own forward (fasttnt.policy.response_logprobs) on the same rows and weights
            diffs.append(mean_logp_diff(mine, theirs))
            if stale_weights(diffs[-1], limit):
                raise StaleWeightsError(
                    f"step {step}: {name}'s log-probs of a probe under weight version {v} differ from the trainer's "
                    f"by {diffs[-1]:.3g} per token, past rollout.max_logp_diff={limit}: the push did not arrive "
                    "whole; not training on its batches"
                )
        return max(diffs)

    def _send(self, version: int) -> None:
        """Version ``version`` to the workers: in the background over gloo, at once over NCCL (``send_weights``)."""
        self.pending += send_weights(self.model, version, dsts=self.worker_ranks, src=TRAINER, group=self.push_link,
                                     bucket_bytes=self.bucket_bytes, wait=False, timeout=self.timeout,
                                     nccl=self.nccl)  # fmt: skip

    def wait(self) -> None:
        """Every push sent taken (at the run's end)."""
        for work in self.pending:
            work.wait()
        self.pending = []
