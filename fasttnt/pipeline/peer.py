"""Point-to-point messages between a trainer and a rollout worker, each wait bounded: a peer that died ends the wait
at once (its connection closes), one that stopped answering ends it after ``rollout.worker_timeout`` seconds, and
either is a ``PeerLostError`` that names the peer and what was awaited, never a hang.

gloo closes the connection of a wait that timed out, so a timeout cannot be retried: it is the end of the run.

The messages travel on a process group: torch.distributed's default world (``group=None``), or a ``link`` of their
own between processes whose default worlds differ (a vLLM worker's engine holds its own world: its external launcher
builds groups on every rank of the default one). Ranks are the group's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

ALIGN = 8  # bytes: each tensor in a message starts at a multiple of it, so that it can be viewed in place as its dtype


def padding(nbytes: int) -> int:
    """The bytes that follow ``nbytes`` of a tensor in a message, up to the next multiple of ``ALIGN``."""
    return -nbytes % ALIGN


class PipelineError(RuntimeError):
    """A run with rollout workers cannot go on: a peer is gone, sent what cannot be used, or is too far behind."""


class PeerLostError(PipelineError):
    """The process at the other end died or stopped answering."""


def trainer_name(rank: int | str) -> str:
    """How a message names the trainer at launched rank ``rank``."""
    return f"the trainer (rank {rank})"


def worker_name(rank: int | str) -> str:
    """How a message names the rollout worker at launched rank ``rank``."""
    return f"rollout worker rank {rank}"


def wait_for(work, *, peer: str, what: str, timeout: float | None) -> None:
    """Wait for ``work`` (``isend`` / ``irecv`` here) at most ``timeout`` seconds (None: the process group's own)."""
    start = time.monotonic()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as err:
        waited = time.monotonic() - start
        if timeout is not None and waited >= 0.99 * timeout:
            raise PeerLostError(
                f"{peer} stopped answering: no {what} for {waited:.0f} s (rollout.worker_timeout={timeout:g})"
            ) from err
        raise _gone(peer, what, err) from err


WATCHDOG_EXIT = 3  # the exit status of a process its watchdog stopped
ABORT_GRACE_S = 10.0  # the longest the watchdog waits for the communicator's abort before the process ends anyway


@contextlib.contextmanager
def watchdog(*, peer: str, what: str, timeout: float | None, abort: Callable[[], None]) -> Iterator[None]:
    """Bound a wait that has no timeout of its own: NCCL's broadcasts and the stream synchronisation after them
    block for ever on a peer that died or stopped. After ``timeout`` seconds (None: unbounded) a thread aborts the
    communicator (``abort``: vLLM's ``PyNcclCommunicator.destroy``, its ncclCommAbort) and ends the process with one
    line naming the peer; a thread, since the blocked main thread cannot raise, and the process's end, since a
    launcher then ends the run's other processes."""
    if timeout is None:
        yield
        return
    done, decided = threading.Event(), threading.Lock()  # the lock: the wait's end and the watchdog's, one of them

    def watch() -> None:
        if done.wait(timeout):
            return
        with decided:
            if done.is_set():  # the wait ended as the timeout passed: it is over, nothing to stop
                return
            print(f"fasttnt: {peer} took no part in {what} for {timeout:g} s (rollout.worker_timeout): aborting the "
                  "NCCL communicator and stopping the run", file=sys.stderr, flush=True)  # fmt: skip
            # an abort that blocks (a teardown waiting on the stuck kernels) must not keep the process alive
            aborting = threading.Thread(target=abort, name="fasttnt-nccl-abort", daemon=True)
            aborting.start()
            aborting.join(ABORT_GRACE_S)
            sys.stdout.flush()
            os._exit(WATCHDOG_EXIT)

    thread = threading.Thread(target=watch, name="fasttnt-nccl-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with decided:
            done.set()
        thread.join()


def link(host: str, port: int, rank: int, world: int, *, name: str, timeout: float) -> dist.ProcessGroup:
    """A gloo group ``name`` of ``world`` processes outside torch.distributed's default world (no
    ``init_process_group``, so none of its collectives), met at the store on ``host:port`` (``store_at``) within
    ``timeout`` seconds (else a ``PeerLostError``). Its point-to-point messages are this module's, ranks being the
    link's own."""
    try:
        store = dist.PrefixStore(name, store_at(host, port, rank, world, timeout=timeout))
        return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout))
    except RuntimeError as err:  # torch's store timeout (DistStoreError), or a refused or closed connection
        raise PeerLostError(
            f"the run's {world} processes did not all join the link {name!r} within {timeout:g} s "
            f"(rollout.worker_timeout): {str(err).splitlines()[0]}"
        ) from err


def store_at(host: str, port: int, rank: int, world: int, *, timeout: float) -> dist.Store:
    """The rendezvous store on ``host:port`` as torch's ``tcp://`` rendezvous finds it: torchrun's agent hosts it
    (``TORCHELASTIC_USE_AGENT_STORE``), or else rank 0 does, one server for every store of its process on that
    port (multi-tenant)."""
    url = f"tcp://{host}:{port}?rank={rank}&world_size={world}"
    store, _, _ = next(dist.rendezvous(url, timeout=timedelta(seconds=timeout)))
    return store


def rank_in(group=None) -> int:
    """This process's rank in ``group`` (None: the default world)."""
    return (group or dist.group.WORLD).rank()


def isend(tensor: torch.Tensor, dst: int, *, peer: str, what: str, group=None):
    """Post a send of ``tensor`` to rank ``dst`` of ``group``; a peer already gone is a ``PeerLostError`` (gloo
    refuses to post to a closed connection)."""
    try:
        return (group or dist.group.WORLD).send([tensor], dst, 0)
    except RuntimeError as err:
        raise _gone(peer, what, err) from err


def irecv(tensor: torch.Tensor, src: int, *, peer: str, what: str, group=None):
    """Post a receive into ``tensor`` from rank ``src`` of ``group``; a peer already gone is a ``PeerLostError``."""
    try:
        return (group or dist.group.WORLD).recv([tensor], src, 0)
    except RuntimeError as err:
        raise _gone(peer, what, err) from err


def recv_from(tensor: torch.Tensor, src: int, *, peer: str, what: str, timeout: float | None, group=None) -> None:
    """Receive ``tensor`` from rank ``src`` within ``timeout`` seconds (``wait_for``)."""
    wait_for(irecv(tensor, src, peer=peer, what=what, group=group), peer=peer, what=what, timeout=timeout)


def send_to(tensor: torch.Tensor, dst: int, *, peer: str, what: str, timeout: float | None, group=None) -> None:
    """Send ``tensor`` to rank ``dst`` within ``timeout`` seconds (``wait_for``)."""
    wait_for(isend(tensor, dst, peer=peer, what=what, group=group), peer=peer, what=what, timeout=timeout)


def _gone(peer: str, what: str, err: RuntimeError) -> PeerLostError:
    reason = str(err).split("] ", 1)[-1].split(". ")[0]  # gloo's "[file:line] Connection closed by peer ..."
    return PeerLostError(f"{peer} is gone: its connection closed while waiting for {what} ({reason})")
