"""A rollout worker's process (``rollout.workers``): ``serve`` builds what a rollout needs, then generates each step's
batch with weights no more than ``rollout.max_staleness`` versions old and ships it to the trainers, taking their
weight pushes in between (the protocol: ``fasttnt.pipeline.remote``'s docstring). At k >= 1 it also runs the push
check's half on its side (a probe's log-probs under each version it takes) and, on vLLM, holds vLLM's log-probs of
its samples against its Hugging Face copy's (``_check_engine``).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from .. import distributed, run_setup
from ..config import TrainConfig
from ..data import dataset_style, think_end_token_id
from ..engines import build_engine
from ..engines.batch import RolloutBatch
from ..guard import StaleWeightsError, mean_logp_diff, stale_weights
from ..modes import ModeMix, behaviour_logprobs
from ..policy import PolicyHead, batch_logprobs
from ..preemption import EXIT_PREEMPTED, StopSignals
from ..rollouts import Rollouts
from ..step_metrics import PhaseClock
from ..stream import ProblemStream
from ..verify import VerifierPool
from .peer import PeerLostError, recv_from, send_to, trainer_name
from .push import checks_pushes, probe_rows
from .remote import shipment_limits
from .roles import TRAINER, join
from .staleness import oldest_version
from .vllm_transfer import BACKEND, NCCL_BACKEND, register
from .weights import layout, recv_weights
from .wire import Shipment, recv_shipment, send_shipment


def serve(cfg: TrainConfig, out: Path, *, resume: bool) -> int:
    """A rollout worker's process: build what a rollout needs, then generate each step's batch with weights no more
    than ``rollout.max_staleness`` versions old and ship it to the trainer, until the run's last step."""
    del out, resume  # the trainer owns the run's files and says where it starts
    # SIGTERM or SIGINT (a launcher passes them to every rank; a scheduler may send one to this rank alone): the
    # worker keeps shipping, and says so with its next batch, while the trainer finishes its step, saves and exits
    with StopSignals() as signals:
        return _serve(cfg, signals)


def _serve(cfg: TrainConfig, signals: StopSignals) -> int:
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
        register()  # the backend, with vLLM's factory in this process (the engine builds it with the model)
        engine = build_engine("vllm", model, tokenizer, settings)
        for rank in pipeline.ranks.trainer_ranks:
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
    unchecked: dict[int, RolloutBatch] = {s.step: s.scored.batch for s in back} if check_pushes else {}
    probe_version, probe_logp = -1, None
    if version in unchecked:  # resumed at k >= 1: the checkpoint's weights are a version taken like any push
        probe_version, probe_logp = version, _probe_logprobs(cfg, head, probe_rows(unchecked.pop(version)))
    idle = 0.0  # seconds waiting since the last batch was generated: for weights, and for the trainer to take it
    try:
        for step in range(first + 1, cfg.steps + 1):
            while version < oldest_version(step, cfg.rollout.max_staleness):
                waited = time.perf_counter()
                version = receive()
                idle += time.perf_counter() - waited
                # the push check (fasttnt.pipeline.remote's docstring): this version's log-probs of its probe
                if check_pushes:
                    probe_version, probe_logp = version, _probe_logprobs(cfg, head, probe_rows(unchecked.pop(version)))
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
            send_shipment(shipment, pipeline.ranks.trainer_ranks, group=link, timeout=timeout)
            idle = time.perf_counter() - waited
            probe_version, probe_logp = -1, None
            if check_pushes:
                unchecked[step] = rolled.drawn.batch
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
    diff = mean_logp_diff(copy, rows.rollout_logp, keep=keep)
    limit = cfg.rollout.max_logp_diff
    if stale_weights(diff, limit):
        raise StaleWeightsError(
            f"vLLM's log-probs of its samples differ from its Hugging Face copy's under weight version {version} by "
            f"{diff:.3g} per token, past rollout.max_logp_diff={limit}: vLLM did not load the push whole"
        )


def _probe_logprobs(cfg: TrainConfig, head: torch.nn.Module, probe: RolloutBatch) -> torch.Tensor:
    """The log-probs (n,) of ``probe``'s response tokens under ``head`` (the worker model's ``PolicyHead``), through
    the pass the trainer's ``Actor.logprobs`` runs (``policy.batch_logprobs``): equal weights give equal numbers."""
    bf16 = run_setup.bf16_autocast(cfg, next(head.parameters()).device)
    return batch_logprobs(head, probe, micro_batch_tokens=cfg.micro_batch_tokens, temperature=cfg.rollout.temperature,
                          bf16=bf16)  # fmt: skip
