"""``python -m nccl_standin train ...`` (this folder on ``PYTHONPATH``): ``fasttnt train`` with the varied reward
scheme (``varied``) and ``rollout.weight_transfer=nccl`` on the CPU, NCCL's group stood in by ``GlooAsNccl``: NCCL
needs CUDA, the calls and the order around it (the header, each worker's word, the broadcasts, a push deferred until
the next batch is in at k = 1) run here."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch


class GlooAsNccl:
    """vLLM's ``PyNcclCommunicator`` as fasttnt-nccl's two ends use it (``device``, ``broadcast(tensor, src)``), over
    a gloo group met at ``host:port``. Built where the nccl engine and the trainer build their group
    (``vllm.distributed.weight_transfer.nccl_common.stateless_init_process_group``, patched), with its arguments."""

    def __init__(self, host: str, port: int, rank: int, world: int, device) -> None:
        # rank 0 hosts the store, as in vLLM's StatelessProcessGroup (not the launcher's agent: peer.store_at's)
        timeout = timedelta(seconds=120)
        store = torch.distributed.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
        self.group = torch.distributed.ProcessGroupGloo(store, rank, world, timeout)
        self.device, self.broadcasts = torch.device("cpu"), 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
        self.broadcasts += 1

    def destroy(self) -> None:
        """vLLM's abort of the communicator (ncclCommAbort); here the gloo group's."""
        print("GlooAsNccl: aborted", file=sys.stderr, flush=True)
        self.group.abort()


def stand_in() -> None:
    """NCCL's group, stood in by ``GlooAsNccl`` on the CPU, in this process."""
    from vllm.distributed.weight_transfer import nccl_common

    import fasttnt.pipeline.roles as roles

    nccl_common.stateless_init_process_group = GlooAsNccl
    roles.NCCL_DEVICE_TYPES = ("cuda", "cpu")


def main() -> int:
    import varied  # this folder is on PYTHONPATH where this runs as a module; the tests import the class alone

    stand_in()
    varied.register()
    from fasttnt.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
