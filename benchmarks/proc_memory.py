"""A process's resident set and its high-water marks, from Linux's /proc: the benchmarks' memory columns.

A window's peak is the kernel's ``VmHWM`` after a reset through ``/proc/self/clear_refs`` to the resident set at the
window's start, so memory a process touched before the window (a temporary freed while its inputs were made, an
import) is not counted in it, as it would be in ``ru_maxrss``. Linux only: ``available()`` says.
"""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def available() -> bool:
    return _STATUS.exists() and _CLEAR_REFS.exists()


def status_mib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the high-water mark since the start or the last reset) of this process."""
    found = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"{_STATUS} has no {field}")
    return int(found.group(1)) / 1024


class Peaks:
    """The resident set's high-water marks of this process: over the whole run, and over windows (an update, one
    op's forward and backward)."""

    def __init__(self) -> None:
        self.run_mib = status_mib("VmHWM")
        self.window_start_mib = 0.0

    def start_window(self) -> None:
        self.run_mib = max(self.run_mib, status_mib("VmHWM"))
        self.window_start_mib = status_mib("VmRSS")
        _CLEAR_REFS.write_text("5")  # the high-water mark back to the present resident set

    def end_window(self) -> dict[str, float]:
        """The window's peak resident set and its rise over the resident set at the window's start (MiB)."""
        peak = status_mib("VmHWM")
        self.run_mib = max(self.run_mib, peak)
        return {"peak_mib": peak, "rise_mib": peak - self.window_start_mib}

    def run_peak(self) -> float:
        return max(self.run_mib, status_mib("VmHWM"))
