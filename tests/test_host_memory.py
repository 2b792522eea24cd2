"""fasttnt.host_memory: freed tensors leave the resident set (glibc on Linux), in a fresh interpreter each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fasttnt import host_memory

pytestmark = pytest.mark.skipif(
    host_memory._libc() is None or not Path("/proc/self/status").exists(), reason="glibc on Linux"
)

# A 16 MiB block freed first raises glibc's dynamic mmap threshold to 16 MiB, as a rollout's and an update's
# freed blocks do; then 2 MiB blocks, touched, each followed by a small block kept alive (so that the freed ones
# cannot merge into the top of the heap, which glibc trims by itself): without the setting they come from the heap
# and stay resident when freed
SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from small import resident_mib
from fasttnt import host_memory
if {set_it}:
    assert host_memory.serve_large_blocks_from_mmap()
big = torch.ones(4 * 2**20); del big
blocks, kept = [], []
for _ in range(100):
    blocks.append(torch.ones(2**19))  # 2 MiB
    kept.append(torch.ones(1024))  # 4 KiB
held = resident_mib()
del blocks
print(held - resident_mib())
"""


def _freed_mib(set_it: bool) -> float:
    script = SCRIPT.format(tests=str(Path(__file__).parent), set_it=set_it)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def test_tensors_of_a_mib_and_more_leave_the_resident_set_when_freed():
    assert _freed_mib(False) < 50, "precondition: without the setting, glibc keeps the freed 2 MiB blocks"
    assert _freed_mib(True) > 150, "the 200 MiB freed stayed resident"
