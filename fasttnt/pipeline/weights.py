"""The trainer's weights to a rollout worker, in buckets, over torch.distributed's point-to-point ``send`` /
``recv``: what a worker that holds its own copy of the model receives after each update.

A push is a header (int64: a magic number, the weight version, the number of parameters, and a signature of their
names, shapes and dtypes) and then one uint8 message per bucket (``layer_buckets``: whole decoder layers, about
``bucket_bytes`` each), every parameter's bytes back to back, padded to 8 bytes. Under ZeRO-3 the sender gathers one
bucket at a time (the gather is collective: every training rank calls ``send_weights``, the one named ``src`` sends),
so the extra memory is one bucket of full parameters. The receiver checks the signature against its own model before
it copies anything: a model of another shape is a ``WeightPushError``, never weights loaded out of place.

A receiver without the trainer's model (vLLM's, whose parameters are fused and repacked) reads the push by its
``layout``: each bucket's ``Slot``s (name, dtype, full shape), the same on both sides; ``recv_header`` and
``recv_bucket`` are the two halves every receiver shares (``recv_weights`` here, the vLLM worker's
``fasttnt.pipeline.vllm_transfer``).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import distributed
from ..engines.weight_buckets import layer_buckets
from .peer import (
    PipelineError,
    isend,
    padding,
    rank_in,
    recv_from,
    trainer_name,
    wait_for,
    watchdog,
    worker_name,
)

MAGIC = 0x7F7A_7477_0001  # "fasttnt weights", format 1


class WeightPushError(PipelineError):
    """A weight push that cannot be loaded: another model's parameters, or a broken message."""


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a push: its name, dtype and full (unsharded) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_list(self) -> list:
        """As plain values (a vLLM engine's init info): ``[name, dtype name, shape]``."""
        return [self.name, str(self.dtype).removeprefix("torch."), list(self.shape)]

    @classmethod
    def from_list(cls, value: list) -> Slot:
        name, dtype, shape = value
        return cls(name, getattr(torch, dtype), tuple(shape))


Layout = list[list[Slot]]  # the buckets of a push, in order


def layout(model: torch.nn.Module, bucket_bytes: int) -> Layout:
    """The buckets ``send_weights`` sends for ``model`` (``layer_buckets``), as ``Slot``s."""
    return [
        [Slot(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for name, p in bucket]
        for bucket in layer_buckets(model, bucket_bytes)
    ]


def signature(buckets: Layout) -> int:
    """A 32-bit checksum of a layout's parameter names, full shapes and dtypes, in order."""
    text = ";".join(f"{s.name}:{s.shape}:{s.dtype}" for bucket in buckets for s in bucket)
    return zlib.crc32(text.encode())


def send_weights(
    model: torch.nn.Module, version: int, *, dsts: Sequence[int], src: int, bucket_bytes: int, group=None,
    wait: bool = True, timeout: float | None = None, nccl=None,
) -> list:  # fmt: skip
    """Push ``model``'s weights as ``version`` from rank ``src`` to each of ranks ``dsts``; under ZeRO-3 every rank
    that holds a shard calls it (the gathers are collective, once per bucket whatever the receivers) and ``src``
    alone sends. ``wait=False``: the sends run in the background from copies of the weights (the model may change at
    once); returns their handles (``wait()``, ``done()``). Each send is taken within ``timeout`` seconds
    (``peer.wait_for``). ``nccl`` (on ``src``: vLLM's ``PyNcclCommunicator``, the sender its rank 0, the receivers
    the others): the header goes over ``group`` as always, each receiver says it took it (a push of another model
    is refused there, before any bucket moves), and the buckets are broadcast device to device, synchronously
    (``vllm_transfer``'s nccl engine), within ``timeout`` seconds or the process ends (``peer.watchdog``)."""
    sending = rank_in(group) == src
    sent = []
    what = f"weight version {version} to be taken"

    def send(message: torch.Tensor) -> None:
        for dst in dsts:  # one message, posted to every receiver before any is waited for
            worker = worker_name(dst)
            sent.append(_Sent(isend(message, dst, peer=worker, what=what, group=group), message, worker, what, timeout))
        if wait:
            for work in sent:
                work.wait()
            sent.clear()

    if sending:
        buckets = layout(model, bucket_bytes)
        count = sum(len(bucket) for bucket in buckets)
        send(torch.tensor([MAGIC, version, count, signature(buckets)], dtype=torch.int64))
        if nccl is not None:  # each receiver's word that it took the header, so no broadcast waits on a refusal
            for dst in dsts:
                recv_from(torch.empty(1, dtype=torch.int64), dst, peer=worker_name(dst),
                          what=f"its word that weight version {version} is welcome", timeout=timeout,
                          group=group)  # fmt: skip
    broadcasting = sending and nccl is not None
    receivers = ", ".join(worker_name(dst) for dst in dsts)
    bounded = watchdog(peer=receivers, what=f"weight version {version}'s broadcasts", timeout=timeout,
                       abort=nccl.destroy) if broadcasting else contextlib.nullcontext()  # fmt: skip
    with bounded:
        for bucket in layer_buckets(model, bucket_bytes):
            params = [p for _, p in bucket]
            with distributed.gathered(params):
                if broadcasting:
                    nccl.broadcast(_packed(params, nccl.device), src=0)
                elif sending:
                    send(_packed(params))  # a copy: the model may change while a background send is in flight
        if broadcasting and nccl.device.type == "cuda":
            torch.cuda.current_stream(nccl.device).synchronize()  # every bucket delivered before the weights change
    return sent


class _Sent:
    """A background send and the tensor it sends (kept alive until it is done)."""

    def __init__(self, work, tensor: torch.Tensor, peer: str, what: str, timeout: float | None) -> None:
        self.work, self.tensor, self.peer, self.what, self.timeout = work, tensor, peer, what, timeout

    def wait(self) -> None:
        wait_for(self.work, peer=self.peer, what=self.what, timeout=self.timeout)
        self.tensor = None

    def done(self) -> bool:
        """Whether the send is over, without waiting (one that failed is dropped too: its worker is gone, which the
        trainer's next receive from it says)."""
        return self.work.is_completed()


def recv_weights(
    model: torch.nn.Module, *, src: int, bucket_bytes: int, group=None, timeout: float | None = None
) -> int:
    """Receive a push from rank ``src`` (``send_weights``) into ``model``'s parameters, each message within
    ``timeout`` seconds (``peer.wait_for``); returns its version."""
    buckets = layout(model, bucket_bytes)
    version = recv_header(buckets, src=src, group=group, timeout=timeout)
    with torch.no_grad():
        for bucket, params in zip(buckets, layer_buckets(model, bucket_bytes), strict=True):
            for (_, tensor), (_, param) in zip(recv_bucket(bucket, version, src=src, group=group, timeout=timeout),
                                               params, strict=True):  # fmt: skip
                param.copy_(tensor)
    return version


def recv_header(buckets: Layout, *, src: int, group=None, timeout: float | None = None) -> int:
    """A push's header from rank ``src``, checked against the receiver's ``buckets``; returns its version."""
    header = torch.empty(4, dtype=torch.int64)
    recv_from(header, src, peer=trainer_name(src), what="a weight push", timeout=timeout, group=group)
    magic, version, count, sent = header.tolist()
    mine = signature(buckets)
    if magic != MAGIC:
        raise WeightPushError(f"rank {src}: not a fasttnt weight push (magic {magic:#x})")
    if count != sum(len(bucket) for bucket in buckets) or sent != mine:
        raise WeightPushError(
            f"rank {src} pushed the weights of another model ({count} parameters, signature {sent:#x}; this worker's "
            f"model has signature {mine:#x}): not loading them"
        )
    return version


def recv_bucket(
    bucket: list[Slot], version: int, *, src: int, group=None, timeout: float | None = None
) -> list[tuple[str, torch.Tensor]]:
    """One bucket of push ``version`` from rank ``src``: its parameters by name, views of one fresh buffer."""
    buffer = bucket_buffer(bucket, "cpu")
    recv_from(buffer, src, peer=trainer_name(src), what=f"weight version {version}", timeout=timeout, group=group)
    return bucket_views(bucket, buffer)


def bucket_buffer(bucket: list[Slot], device: torch.device | str) -> torch.Tensor:
    """An empty message (uint8) of ``bucket``'s size on ``device``: each parameter's bytes padded to ``ALIGN``."""
    return torch.empty(sum(s.nbytes + padding(s.nbytes) for s in bucket), dtype=torch.uint8, device=device)


def bucket_views(bucket: list[Slot], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A received bucket's parameters by name: views of ``buffer`` (``bucket_buffer``'s)."""
    named, at = [], 0
    for slot in bucket:
        named.append((slot.name, buffer[at : at + slot.nbytes].view(slot.dtype).view(slot.shape)))
        at += slot.nbytes + padding(slot.nbytes)
    return named


def _packed(params: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """The parameters' bytes back to back on ``device``, each padded to ``ALIGN``."""
    parts = []
    for param in params:
        raw = param.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, torch.zeros(padding(raw.numel()), dtype=torch.uint8, device=device)]
    return torch.cat(parts)
