"""Test set-up for the whole suite: the Triton interpreter on CPU-only machines, and fresh seeds."""

from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch
from support.small import SEED

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when fasttnt_kernels is imported: set it before
# any test module imports it. With a GPU the kernels run natively on CUDA tensors instead.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the runs a test launches in other processes read it too
os.environ["FASTTNT_TEST_SEED"] = str(SEED)
REPLAY = f"FASTTNT_TEST_SEED={SEED}"


def pytest_configure(config):
    # the reward scheme whose rewards vary by construction (support/varied.py), for the trainer tests
    from support import varied

    varied.register()
    # under pytest-xdist (the README's -n auto: a worker per core) each worker and the processes it starts take one
    # thread: two torch processes of two threads each on two cores spin in OpenMP and run several times slower
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_report_header(config):
    where = "CUDA (native Triton)" if HAS_CUDA else "CPU (Triton interpreter)"
    return f"fasttnt: kernels on {where}; {REPLAY}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # a failure names the seed that replays it, in its own section of the failure's report
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("fasttnt seed", f"replay: {REPLAY} python -m pytest '{item.nodeid}'"))


def pytest_terminal_summary(terminalreporter):
    # -q hides the header: the seed is printed again at the end of the run, which -q keeps
    terminalreporter.write_line(f"fasttnt: {REPLAY} (set it to replay this run)")


@pytest.fixture(autouse=True)
def _seed(request):
    # one stream per test, so a test's inputs do not depend on which tests ran before it
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


# DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank and port in /dev/shm after its processes exit
# (deepspeed_allreduce_buffer_<rank>_<addr>_<port>_<n>, 67 MB each with deepspeed 0.19): the suite's 2-rank runs
# filled a 24 GB /dev/shm over a day of runs. Remove the ones this session made.
_SHM = "/dev/shm"
_SHM_PREFIX = "deepspeed_allreduce_buffer_"


def _shm_buffers() -> set[str]:
    try:
        return {name for name in os.listdir(_SHM) if name.startswith(_SHM_PREFIX)}
    except OSError:
        return set()


_SHM_BEFORE = _shm_buffers()


def pytest_sessionfinish(session, exitstatus):
    for name in _shm_buffers() - _SHM_BEFORE:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))
