"""Preemption: SIGTERM and SIGINT ask a run to stop after its step, with a checkpoint, and every rank agrees on
the step at which it stops (``distributed.any_over_ranks``, in ``Trainer.run``)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from tqdm.auto import tqdm

EXIT_PREEMPTED = 3  # the exit code of a run stopped by SIGTERM or SIGINT after saving: resume it


class Preempted(Exception):
    """The run stopped at a signal, after its step and a checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopSignals:
    """SIGTERM and SIGINT ask the run to stop after the current step (clusters give a grace period before they
    kill a job: SLURM, Kubernetes); a second SIGINT (a person at the terminal) stops it at once. A repeated SIGTERM
    changes nothing: under a launcher the ranks get it twice, from the scheduler and from the launcher. The
    handlers are installed for the duration of ``run`` (main thread only) and the previous ones put back after."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: now
                self.__exit__()
                raise KeyboardInterrupt("SIGINT again: stopping at once")
            return
        self.requested = name
        tqdm.write(f"{name}: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)")
