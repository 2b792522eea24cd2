"""Verification in bulk: ``verify_batch`` decides what strings and numbers can in the calling process and sends
the rest to worker processes (``VerifierPool``), each item under a hard timeout; a worker that hangs is killed and
its item counts as wrong. Workers also end without the pool: each item has a CPU limit, and a worker dies with the
process that started the pool (its trainer), even one killed with SIGKILL."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

from .answers import (
    DEFAULT_TIMEOUT,
    MAX_ANSWER_CHARS,
    extract_answer,
    fast_equivalent,
    is_equivalent,
    symbolic_equivalent,
)

try:
    import resource
except ImportError:  # not on this platform (Windows): the pool's timeout still bounds each item
    resource = None


class Verdicts(list):
    """``list[bool]``, one per response, with counts of how each was decided."""

    def __init__(self, values, *, fast: int, symbolic: int, timeouts: int, crashes: int, no_answer: int, seconds):
        super().__init__(values)
        self.fast = fast  # decided by strings/numbers in the calling process
        self.symbolic = symbolic  # sent to a worker
        self.timeouts = timeouts  # killed at the timeout: counted wrong
        self.crashes = crashes  # the worker died (e.g. out of memory): counted wrong
        self.no_answer = no_answer  # nothing to extract
        self.seconds = seconds


WORKER_MEMORY_BYTES = 4 * 2**30
"""Address-space cap of a verification worker: a power tower that allocates instead of hanging fails fast."""

_READY = "ready"  # a worker's first message: it started, imported math-verify and can take items
STARTUP_TIMEOUT = 120.0
"""Seconds a worker may take to start (math-verify's import) before the pool gives up: an item's own timeout
counts from its worker's start, so a slow start on a busy machine is not a wrong answer."""


class VerifierStartupError(RuntimeError):
    """Verification workers die before they can judge anything: a broken set-up, never a wrong answer."""


_PR_SET_PDEATHSIG = 1  # prctl option, from <linux/prctl.h>
TRAINER_POLL_SECONDS = 0.5
"""How often a worker checks that its trainer is still alive (the watchdog thread, see ``_exit_with_trainer``)."""


def _worker_main(conn: Connection, memory_bytes: int, cpu_seconds: int, trainer_pid: int) -> None:
    # SLURM's scancel and a terminal's Ctrl-C signal every process of the job: a worker that died of it would turn
    # its item into a wrong answer, while the trainer finishes its step. The pool ends its workers itself (an
    # item's end, close(), SIGKILL at a timeout or at exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # so a worker must end by itself when its trainer dies, even of SIGKILL (which runs none of the trainer's
    # clean-up); multiprocessing's resource tracker then ends too, once every holder of its pipe has ended
    _die_with_parent()
    _let_the_forkserver_end()
    _exit_with_trainer(trainer_pid)
    if resource is not None:
        with contextlib.suppress(ValueError, OSError):  # not allowed here: the timeout still bounds the item
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        # SIGXCPU's default action ends the process even inside a long C call, where a Python handler never runs
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        # that default action also dumps core: a file as large as the worker's memory, of no use to anyone
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    symbolic_equivalent("1", "1")  # import math-verify and warm its caches before the first real item
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, pred, gold = task
        _limit_cpu(cpu_seconds)
        try:
            verdict = is_equivalent(pred, gold)
        except MemoryError:
            verdict = False
        conn.send((index, verdict))


def _limit_cpu(seconds: int) -> None:
    """Let this process use at most ``seconds`` more CPU seconds: past them the kernel sends SIGXCPU, which ends
    it, so a runaway item ends even when no pool is left to kill its worker."""
    if resource is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(time.process_time()) + seconds  # the limit counts the process's whole CPU time so far
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)  # at the hard limit the kernel sends SIGKILL instead, which ends it as well
    with contextlib.suppress(ValueError, OSError):  # not allowed here: the pool's timeout still bounds the item
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies. That ends even a worker stuck in one long
    C call (a power tower's integer power holds the GIL, so no Python code of the worker runs until it returns).

    The signal follows the death of the parent's thread that forked this process: the forkserver has only one."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed in a verification worker: {os.strerror(errno)}")


def _let_the_forkserver_end() -> None:
    """Drop this worker's copy of the fd that keeps multiprocessing's forkserver (this worker's parent) running.

    The forkserver exits when every copy of that fd is closed; each process it forks gets one, so a worker would
    keep it alive after the trainer's death and ``_die_with_parent`` would never fire. Without this copy, the
    trainer's death ends the forkserver, whose death ends the worker. This worker starts no process itself, so it
    needs no forkserver."""
    try:
        from multiprocessing import forkserver
    except ImportError:  # no forkserver on this platform (Windows)
        return
    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def _exit_with_trainer(pid: int) -> None:
    """A daemon thread that ends this process (``os._exit``) once process ``pid`` is gone.

    It needs neither prctl nor the forkserver's exit, so it also covers a platform without them, a forkserver kept
    up by other processes, and an idle worker whose pipe's other end lives on in a process the trainer forked. It
    runs only when the main thread lets go of the GIL (Python code does, a single long C call does not: there
    ``_die_with_parent`` or the CPU limit ends the worker)."""

    def watch() -> None:
        while True:
            time.sleep(TRAINER_POLL_SECONDS)
            try:
                os.kill(pid, 0)  # signal 0: only checks that the process exists
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, name="verifier-trainer-watchdog", daemon=True).start()


class _Worker:
    def __init__(self, ctx, cpu_seconds: int) -> None:
        self.conn, child = ctx.Pipe()
        args = (child, WORKER_MEMORY_BYTES, cpu_seconds, os.getpid())
        self.process = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[int, str, str, float] | None = None  # (index, pred, gold, start time) while busy
        self.ready = False  # said it started: a death before that is a set-up failure, not an item's crash

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class VerifierPool:
    """Worker processes for symbolic verification, each item under a hard timeout. Reuse one across steps;
    workers start on the first item that needs one."""

    def __init__(self, workers: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.size = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout = timeout
        # CPU seconds an item may use before the kernel ends its worker: more than the timeout, so the pool's own
        # kill comes first while the pool runs; the limit ends an item whose pool is gone (a killed trainer)
        self.cpu_seconds = math.ceil(timeout) + 1
        # forkserver: workers fork from a clean server process (not from a parent holding torch's threads), and
        # a replacement for a killed worker starts in milliseconds with math-verify already imported
        method = "forkserver" if sys.platform.startswith("linux") else "spawn"
        self._ctx = mp.get_context(method)
        if method == "forkserver":
            self._ctx.set_forkserver_preload(["math_verify", "fasttnt.verify.pool"])
        self._workers: list[_Worker] = []  # changed in place: the finalizer below holds this list
        # at exit, before multiprocessing's own clean-up (which would send SIGTERM, ignored, and wait): kill them
        self._finalizer = weakref.finalize(self, _kill_workers, self._workers)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):  # a worker that already died
                w.conn.send(None)
            w.process.join(timeout=1)
            if w.process.is_alive():
                w.kill()
        self._workers.clear()

    def judge(self, items: list[tuple[int, str, str]]) -> tuple[dict[int, bool], int, int]:
        """Judge (index, pred, gold) items; returns ({index: verdict}, timeouts, crashes).

        A worker that dies on an item (out of memory, a crash in the parser) counts that item wrong, as a crash. A
        worker that dies before it could start is not an answer's fault: its item goes back in the queue, and when
        the replacement dies as well, ``VerifierStartupError`` says why (never a silent wrong answer)."""
        results: dict[int, bool] = {}
        timeouts = crashes = 0
        startup_deaths = 0  # in a row, without any worker starting in between
        pending = deque(items)
        while len(self._workers) < min(self.size, len(items)):
            self._workers.append(_Worker(self._ctx, self.cpu_seconds))
        while pending or any(w.task for w in self._workers):
            for i, w in enumerate(self._workers):
                if w.task is None and pending:
                    index, pred, gold = pending.popleft()
                    try:
                        w.conn.send((index, pred, gold))
                    except (BrokenPipeError, OSError):  # it died while idle (e.g. killed for memory): replace it
                        w.kill()
                        w = self._workers[i] = _Worker(self._ctx, self.cpu_seconds)
                        w.conn.send((index, pred, gold))
                    w.task = (index, pred, gold, time.monotonic())
            busy = [w for w in self._workers if w.task]
            next_deadline = min(w.task[3] + (self.timeout if w.ready else STARTUP_TIMEOUT) for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for i, w in enumerate(self._workers):
                if w.task is None:
                    continue
                index, pred, gold, started = w.task
                if w.conn in ready:
                    try:
                        message = w.conn.recv()
                    except (EOFError, OSError):
                        message = None
                    if message == _READY:
                        w.ready, startup_deaths = True, 0
                        w.task = (index, pred, gold, time.monotonic())  # the item's clock starts now
                        continue
                    if message is not None:
                        got_index, verdict = message
                        results[got_index] = verdict
                        w.task = None
                        continue
                    if not w.ready:  # died while starting: the set-up, not the item
                        startup_deaths += 1
                        w.kill()
                        if startup_deaths >= 2:
                            self._abandon()
                            raise VerifierStartupError(_startup_failure(w.process.exitcode))
                        pending.appendleft((index, pred, gold))
                        self._workers[i] = _Worker(self._ctx, self.cpu_seconds)
                        continue
                    w.process.join(timeout=5)  # it closed its pipe: it is ending, and its exit code says why
                    if resource is not None and w.process.exitcode == -signal.SIGXCPU:  # its item's CPU limit
                        timeouts += 1
                    else:
                        crashes += 1
                elif not w.ready:  # the item's clock starts once its worker has started
                    if time.monotonic() - started < STARTUP_TIMEOUT:
                        continue
                    self._abandon()
                    raise VerifierStartupError(f"a verification worker did not start within {STARTUP_TIMEOUT:.0f} s")
                elif time.monotonic() - started >= self.timeout:
                    timeouts += 1
                else:
                    continue
                results[index] = False
                w.kill()
                self._workers[i] = _Worker(self._ctx, self.cpu_seconds)
        return results, timeouts, crashes

    def _abandon(self) -> None:
        """Kill every worker (their tasks die with them), so that a pool reused after an error starts clean."""
        _kill_workers(self._workers)


def _kill_workers(workers: list[_Worker]) -> None:
    for w in workers:
        if w.process.is_alive():
            w.kill()
    workers.clear()


def _startup_failure(exitcode: int | None) -> str:
    return (
        f"verification workers die as they start (exit code {exitcode}), so no symbolic answer can be judged. "
        "The usual cause: a script that calls verify_batch (or trains) at module level, without "
        '`if __name__ == "__main__":` - each worker re-imports the script and runs it again. Put the script\'s '
        "work under that guard; the workers' own errors are printed above."
    )


def verify_batch(
    responses: list[str],
    golds: list[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    workers: int | None = None,
    pool: VerifierPool | None = None,
    require_think_end: bool = False,
) -> Verdicts:
    """Is each response's final answer equivalent to its gold answer? One bool per response.

    Extraction and the string/number fast path run here; what needs symbolic work goes to ``pool`` (a
    temporary one when None), at most ``timeout`` seconds an item, after which it counts as wrong. The result
    is a list of bools that also carries the counts (``.timeouts``, ``.symbolic``, ...). ``require_think_end``:
    see ``extract_answer``.
    """
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    start = time.perf_counter()
    verdicts: list[bool] = [False] * len(responses)
    symbolic: list[tuple[int, str, str]] = []
    no_answer = 0
    for i, (response, gold) in enumerate(zip(responses, golds, strict=True)):
        pred = extract_answer(response, require_think_end=require_think_end)
        if pred is None:
            no_answer += 1
            continue
        decided = fast_equivalent(pred, gold)
        if decided is not None:
            verdicts[i] = decided
        elif len(pred) <= MAX_ANSWER_CHARS and len(gold) <= MAX_ANSWER_CHARS:
            symbolic.append((i, pred, gold))
    timeouts = crashes = 0
    if symbolic:
        own_pool = pool is None
        pool = pool or VerifierPool(workers, timeout)
        try:
            results, timeouts, crashes = pool.judge(symbolic)
        finally:
            if own_pool:
                pool.close()
        for index, verdict in results.items():
            verdicts[index] = verdict
    return Verdicts(
        verdicts,
        fast=len(responses) - len(symbolic) - no_answer,
        symbolic=len(symbolic),
        timeouts=timeouts,
        crashes=crashes,
        no_answer=no_answer,
        seconds=time.perf_counter() - start,
    )
