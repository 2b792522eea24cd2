"""The weight-transfer engine through which a vLLM engine takes the trainer's pushes: registered with vLLM's
``WeightTransferEngineFactory`` as ``fasttnt-gloo`` (``register``), it receives the buckets that
``fasttnt.pipeline.weights.send_weights`` sends, over a gloo ``peer.link`` to the trainer, on any device.

Written against vLLM 0.31 (``vllm/distributed/weight_transfer/base.py``, its nccl engine ``nccl_engine.py`` for the
reload lifecycle) and run in the tests on its CPU build, through vLLM's own calls: ``LLM(weight_transfer_config=
WeightTransferConfig(backend="fasttnt-gloo"))`` builds it in each worker (``Worker.load_model``), and
``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
reach it through ``collective_rpc``:

* init (``GlooInitInfo``): join the link, and learn the push's layout (each bucket's names, dtypes and full shapes,
  as ``weights.layout`` gives them on the trainer): vLLM's parameters are fused and repacked, so the receiver cannot
  read the layout off its own model.
* start: the push's header, checked against the layout (a push of another model is refused before any layer
  changes), then vLLM's layer-wise reload, as its nccl engine: every layer back in checkpoint format, so the pushed
  tensors load by their Hugging Face names and each layer's post-load processing (the CPU build's repacking, CUDA's
  quantization) runs again once the layer is whole.
* update (``GlooUpdateInfo``): each bucket into ``model.load_weights``, a tied ``lm_head.weight`` by name too
  (``engines.vllm.for_vllm``).
* finish: the reload's end; the push's version is the engine's ``version``.

A rollout worker also keeps its Hugging Face copy of the model (``also_into``): the push checks and the behaviour
log-probs of mode-mixed rollouts run the trainer's own forward on it (``fasttnt.pipeline.worker``).

On CUDA, ``fasttnt-nccl`` (``rollout.weight_transfer=nccl``) moves the same buckets device to device: the header
and the worker's word that it took it still cross the gloo link, then the trainer (rank 0 of an NCCL group of it and
every worker, ``NcclInitInfo``) broadcasts each bucket. The group is vLLM's own ``PyNcclCommunicator`` over its
``StatelessProcessGroup`` rendezvous (``nccl_common.stateless_init_process_group``, as vLLM's nccl engine builds it),
with the worker's rank given here rather than derived from vLLM's parallel config, which knows nothing of the other
workers. An NCCL broadcast has no timeout, so the trainer starts one only once every worker said it is receiving,
and only at k <= 1, where a push is taken as it is sent (``push.WeightPush.sync``). **It has not run on a GPU**:
the tests run its calls, their order and its refusals on the CPU with the NCCL group stood in by gloo.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .peer import link, send_to, trainer_name, watchdog
from .weights import Layout, Slot, bucket_buffer, bucket_views, recv_bucket, recv_header

BACKEND = "fasttnt-gloo"  # the name vLLM's WeightTransferConfig(backend=...) selects this engine by
NCCL_BACKEND = "fasttnt-nccl"  # the same, device to device (rollout.weight_transfer=nccl)


def register() -> None:
    """Make ``fasttnt-gloo`` a weight-transfer backend of vLLM, once per process (before an ``LLM`` that uses it
    is built: vLLM builds the engine with the model)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, engine in ((BACKEND, "GlooWeightTransferEngine"), (NCCL_BACKEND, "NcclWeightTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, __name__, engine)
        except ValueError as err:  # registered before, in this process
            if "already registered" not in str(err):
                raise


@dataclass
class GlooInitInfo:
    """The link to the trainer and the layout of its pushes (plain values: vLLM passes a dict)."""

    host: str  # the rendezvous store's (peer.store_at)
    port: int
    name: str  # the link's: its keys' prefix in the store
    rank: int  # this worker's rank in the link
    world: int  # the link's size
    trainer: int  # the trainer's rank in the link: the sender
    buckets: list  # weights.Layout as Slot.to_list values
    timeout: float  # seconds: the link's rendezvous and every message (rollout.worker_timeout)


@dataclass
class NcclInitInfo(GlooInitInfo):
    """``GlooInitInfo`` (the control link, the layout) and the NCCL group's rendezvous on the trainer's host."""

    nccl_port: int  # the StatelessProcessGroup's store, hosted by the trainer (the group's rank 0)
    nccl_rank: int  # this worker's rank in the group: 1 + its place among the workers
    nccl_world: int  # 1 + the workers


@dataclass
class GlooUpdateInfo:
    """One push: nothing to say beyond what the header carries."""


@functools.cache
def _engine_class():
    """The engine, defined where vLLM is importable (this module is imported by the trainer too)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from ..engines.vllm import for_vllm

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False
        backend = BACKEND

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.group = None
            self.layout: Layout = []
            self.trainer, self.timeout = 0, None
            self.incoming: int | None = None  # the version of the push being received (its header's)
            self.also_into: torch.nn.Module | None = None  # a Hugging Face copy that takes each push too
            self.version: int | None = None  # of the last push received whole

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self.layout = [[Slot.from_list(slot) for slot in bucket] for bucket in init_info.buckets]
            self.trainer, self.timeout = init_info.trainer, init_info.timeout
            self.group = link(
                init_info.host,
                init_info.port,
                init_info.rank,
                init_info.world,
                name=init_info.name,
                timeout=self.timeout,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if self.group is None:
                raise RuntimeError(f"the {self.backend} weight transfer was not initialised: call init first")
            # the header first: a push of another model is refused while the model is still whole
            self.incoming = recv_header(self.layout, src=self.trainer, group=self.group, timeout=self.timeout)
            self.took_header()
            initialize_layerwise_reload(self.model)

        def took_header(self) -> None:
            """Where the buckets come over a channel without timeouts, the trainer waits for this first."""

        def bucket(self, bucket: list[Slot]) -> list[tuple[str, torch.Tensor]]:
            """The next bucket of the push, by name."""
            return recv_bucket(bucket, self.incoming, src=self.trainer, group=self.group, timeout=self.timeout)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class then synchronizes torch.accelerator, which raises where there is none (the CPU build)
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
            for bucket in self.layout:
                named = self.bucket(bucket)
                if self.also_into is not None:
                    _copy_into(self.also_into, named)
                self.model.load_weights([pair for name, tensor in named for pair in for_vllm(name, tensor, tied)])
            self.version = self.incoming

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


@functools.cache
def _nccl_engine_class():
    """``fasttnt-nccl``: the gloo engine's control (header, layout, reload, Hugging Face copy), the buckets over NCCL
    (module docstring; not run)."""

    class NcclWeightTransferEngine(_engine_class()):
        init_info_cls = NcclInitInfo
        backend = NCCL_BACKEND

        def init_transfer_engine(self, init_info: NcclInitInfo) -> None:
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

            super().init_transfer_engine(init_info)
            # the worker's device, as vLLM gave it to this engine (its nccl engine reads the same off torch)
            self.nccl = stateless_init_process_group(init_info.host, init_info.nccl_port, init_info.nccl_rank,
                                                     init_info.nccl_world, self.device)  # fmt: skip

        def took_header(self) -> None:
            send_to(torch.ones(1, dtype=torch.int64), self.trainer, peer=trainer_name(self.trainer),
                    what=f"its word that weight version {self.incoming} is welcome", timeout=self.timeout,
                    group=self.group)  # fmt: skip

        def bucket(self, bucket: list[Slot]) -> list[tuple[str, torch.Tensor]]:
            buffer = bucket_buffer(bucket, self.nccl.device)
            self.nccl.broadcast(buffer, src=0)
            return bucket_views(bucket, buffer)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the broadcasts, and the synchronisation that ends the base class's update, wait on the trainer with no
            # timeout of their own
            with watchdog(peer=trainer_name(self.trainer), what=f"weight version {self.incoming}'s broadcasts",
                          timeout=self.timeout, abort=self.nccl.destroy):  # fmt: skip
                super().update_weights(update_info)

        def shutdown(self) -> None:
            super().shutdown()
            self.nccl = None

    return NcclWeightTransferEngine


def __getattr__(name: str):
    # what vLLM's factory loads by name
    if name == "GlooWeightTransferEngine":
        return _engine_class()
    if name == "NcclWeightTransferEngine":
        return _nccl_engine_class()
    raise AttributeError(name)


def _copy_into(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """A bucket's tensors into ``model``'s parameters of the same names."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)
