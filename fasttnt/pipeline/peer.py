"""Point-to-point messages between a trainer and a rollout worker, each wait bounded: a peer that died ends the wait
at once (its connection closes), one that stopped answering ends it after ``rollout.worker_timeout`` seconds, and
either is a ``PeerLostError`` that names the peer and what was awaited, never a hang.

gloo closes the connection of a wait that timed out, so a timeout cannot be retried: it is the end of the run.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


class PipelineError(RuntimeError):
    """A run with rollout workers cannot go on: a peer is gone, sent what cannot be used, or is too far behind."""


class PeerLostError(PipelineError):
    """The process at the other end died or stopped answering."""


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


def isend(tensor: torch.Tensor, dst: int, *, peer: str, what: str, group=None):
    """``dist.isend``; a peer already gone is a ``PeerLostError`` (gloo refuses to post to a closed connection)."""
    try:
        return dist.isend(tensor, dst, group=group)
    except RuntimeError as err:
        raise _gone(peer, what, err) from err


def irecv(tensor: torch.Tensor, src: int, *, peer: str, what: str, group=None):
    """``dist.irecv``; a peer already gone is a ``PeerLostError``."""
    try:
        return dist.irecv(tensor, src, group=group)
    except RuntimeError as err:
        raise _gone(peer, what, err) from err


def recv_from(tensor: torch.Tensor, src: int, *, peer: str, what: str, timeout: float | None, group=None) -> None:
    """``dist.recv`` of ``tensor`` from rank ``src`` within ``timeout`` seconds (``wait_for``)."""
    wait_for(irecv(tensor, src, peer=peer, what=what, group=group), peer=peer, what=what, timeout=timeout)


def send_to(tensor: torch.Tensor, dst: int, *, peer: str, what: str, timeout: float | None, group=None) -> None:
    """``dist.send`` of ``tensor`` to rank ``dst`` within ``timeout`` seconds (``wait_for``)."""
    wait_for(isend(tensor, dst, peer=peer, what=what, group=group), peer=peer, what=what, timeout=timeout)


def _gone(peer: str, what: str, err: RuntimeError) -> PeerLostError:
    reason = str(err).split("] ", 1)[-1].split(". ")[0]  # gloo's "[file:line] Connection closed by peer ..."
    return PeerLostError(f"{peer} is gone: its connection closed while waiting for {what} ({reason})")
