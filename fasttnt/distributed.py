"""Data-parallel training under DeepSpeed ZeRO: process-group set-up, the engine, and global reductions.

A run is distributed when the launcher says so (``WORLD_SIZE > 1``: ``deepspeed --num_gpus N -m fasttnt train``
or ``torchrun --nproc-per-node N -m fasttnt train``). Each rank generates the rollouts of its share of the step's
prompts (all K samples of a prompt on one rank, so advantages stay local), and every normaliser and logged
metric is taken over all ranks, so a 2-rank run logs what a 1-rank run of the same global batch logs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device


# a rank that dies leaves the others blocked in a collective: the launcher kills them (see fail_fast), and this
# timeout bounds the wait if it does not; an hour, since rank 0 alone writes a 7B model's float32 weights (28 GB) to a
# shared filesystem while the others wait at a barrier
COLLECTIVE_TIMEOUT = timedelta(minutes=60)
LAUNCH_RANK = "FASTTNT_LAUNCH_RANK"  # the launcher's RANK, where a run with rollout workers rewrote it (pipeline.roles)


def launch_rank() -> str:
    """This process's rank as the launcher started it (``?`` without a launcher)."""
    return os.environ.get(LAUNCH_RANK) or os.environ.get("RANK", "?")


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (a process that takes it first makes that launch fail)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_device(device_type: str) -> torch.device:
    """This process's device, with its index on CUDA (the current device: ``cuda:0`` in a single process). An
    index-less ``torch.device("cuda")`` is refused by ``torch.cuda.set_device`` ("Expected a torch.device with a
    specified index or an integer, but got:cuda", torch 2.13), which the vllm engine calls once vLLM has started."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(device_type: str) -> DistContext:
    """Join the process group the launcher describes (gloo on the CPU, NCCL on CUDA)."""
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    # a world already made is kept (a run with rollout workers: the trainers', pipeline.roles.join)
    deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def fail_fast(main: Callable[[], int]) -> int:
    """Run ``main``; if it raises on this rank, print the error and exit the process at once (non-zero), so the
    launcher tears the job down instead of the other ranks hanging in their next collective."""
    try:
        return main()
    # every failure, KeyboardInterrupt included, must end the rank
    except BaseException as err:
        rank = launch_rank()
        print(f"[rank {rank}] failed: {type(err).__name__}: {err}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def exit_process(code: int) -> None:
    """End a rank without the interpreter's teardown. Measured here: with ZeRO-3, about one run in five aborted
    after finishing its work ("terminate called without an active exception", exit -6), a native thread torn
    down by the interpreter's exit; everything is written and closed before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def wait_for_ranks(device: torch.device) -> float:
    """Seconds this rank waits, from when its own queued work is done, until every rank has reached this point: a
    one-element all-reduce timed between device synchronizations (on CUDA; the CPU's work is done when queued), so
    the time is the other ranks' lateness plus one small collective's latency."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def all_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_max(n: int, device: torch.device) -> int:
    """The largest ``n`` over the ranks."""
    return int(all_max_tensor(torch.tensor([n], dtype=torch.int64, device=device)).item())


def all_max_tensor(t: torch.Tensor) -> torch.Tensor:
    """The elementwise largest of ``t`` over the ranks."""
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def sum_over_ranks(ctx: DistContext | None, t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (``t`` itself in one process, ``ctx`` None): a collective every rank calls."""
    return all_sum(t) if ctx else t


def sum_named_over_ranks(ctx: DistContext | None, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each named scalar summed over the ranks in one collective: stacked by name and unstacked by the same names,
    so no caller depends on an order."""
    names = list(values)
    total = sum_over_ranks(ctx, torch.stack([values[name].reshape(()) for name in names]))
    return dict(zip(names, total.unbind(0), strict=True))


def max_over_ranks(ctx: DistContext | None, n: int) -> int:
    """The largest ``n`` over the ranks (``n`` itself in one process, ``ctx`` None)."""
    return all_max(n, ctx.device) if ctx else n  # sync: one read


def min_over_ranks(ctx: DistContext | None, t: torch.Tensor) -> float:
    """The smallest element of ``t`` over every rank's (this rank's alone in one process, ``ctx`` None)."""
    smallest = t.min().reshape(1).double()
    return float(-all_max_tensor(-smallest) if ctx else smallest)  # sync: one read


def any_over_ranks(ctx: DistContext | None, *flags: bool) -> tuple[bool, ...]:
    """Each flag, true where it is true on any rank, so that every rank takes the same branch (a stop at a signal,
    another draw of dynamic sampling): one collective for all the flags; in one process (``ctx`` None), the flags."""
    if not ctx:
        return flags
    t = all_max_tensor(torch.tensor([float(f) for f in flags], device=ctx.device))
    return tuple(bool(x) for x in t.tolist())  # sync: one read


def deepspeed_config(cfg, world: int, *, autocast: bool = False) -> dict:
    """The DeepSpeed config from ours: ZeRO stage, clipping, float32 master weights, bf16 autocast in the forward
    when ``autocast``; the optimizer is ours (AdamW)."""
    config = {
        # one optimizer step per engine.step(); we do our own batching, and mark the last micro-batch of a
        # mini-batch with set_gradient_accumulation_boundary (their number varies from step to step)
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {
            "stage": cfg.distributed.zero_stage,
            "overlap_comm": False,
            # measured here: with contiguous gradients, ZeRO-2's first step got a wrong gradient for the tied
            # embedding (grad norm 0.53 against a 1-process 0.21, weights 5e-4 apart after 3 steps); without
            # them a 2-rank run matches the 1-process run to 1e-8
            "contiguous_gradients": False,
            "reduce_bucket_size": cfg.distributed.bucket_size,
            "allgather_bucket_size": cfg.distributed.bucket_size,
            "stage3_param_persistence_threshold": 0,
        },
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},  # float32 master weights, float32 gradients reduced in float32
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if autocast:
        # DeepSpeed 0.19's engine.forward re-enters torch.autocast(enabled=False) when autocast is on outside it and
        # its config has no torch_autocast section (deepspeed/runtime/torch_autocast.py, autocast_if_enabled): the
        # forward would run in float32. Its own section keeps it on; no lower-precision modules, so no parameter
        # gets a bf16 communication dtype and the gradients are still reduced in float32
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return config


def zero3_sharded(params: list[torch.nn.Parameter]) -> bool:
    """Whether any of ``params`` is a ZeRO-3 shard (DeepSpeed marks them with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in params)


def gathered(params: list[torch.nn.Parameter]):
    """Full parameters for the duration where they are ZeRO-3 shards (``zero3_sharded``), on every rank at once
    (the gather is collective); nothing to do otherwise."""
    if zero3_sharded(params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


@contextlib.contextmanager
def zero3_full_model(engine, module: torch.nn.Module):
    """Every parameter of ``module`` gathered, and ZeRO-3's per-module hooks off, for the duration.

    Gathering alone is not enough for generation: the hooks would re-shard each layer after its forward and
    gather it again with a collective at every decode step, and ranks that stop after different numbers of
    tokens would wait on each other forever. With the hooks removed, each rank decodes on its own. (The same
    technique as TRL's ``unwrap_model_for_generation``, written against DeepSpeed's ZeRO-3 offload object.)
    The memory is the whole model on every rank while it lasts.
    """
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with gathered(list(module.parameters())):
        for param in offload.module.parameters(recurse=True):
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # the generation forwards are not the training forward's trace
            offload._register_deepspeed_module(offload.module)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
