"""fasttnt.host_memory: freed tensors leave the resident set (glibc on Linux), in a fresh interpreter each."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.small import glibc_on_linux

from fasttnt import host_memory

pytestmark = pytest.mark.skipif(not glibc_on_linux(), reason="glibc's malloc on Linux")

# A 16 MiB block freed raises glibc's dynamic mmap threshold to 16 MiB, as a model's loading, a rollout's and an
# update's freed blocks do (before the setting and after it: the setting must fix the threshold at 1 MiB, where
# setting another of mallopt's parameters would freeze it at 16 MiB); then 100 blocks (2 MiB unless said), touched.
# The script prints the resident MiB their freeing gave back and the MiB glibc served them from mmap (mallinfo2's
# hblkhd). Whether heap-served blocks stay resident when freed depends on the heap's layout, which varies from run to
# run (with PYTHONHASHSEED, say: freed blocks next to the heap's top merge into it and glibc trims it), so glibc's
# decision is read from its own count, and the resident set only where the decision makes it certain.
SCRIPT = """
import ctypes, sys, torch
sys.path.insert(0, {tests!r})
from support.small import resident_mib
from fasttnt import host_memory
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
big = torch.ones(4 * 2**20); del big  # before the setting too, as a model's loading frees large blocks
if {set_it}:
    assert host_memory.serve_large_blocks_from_mmap()
big = torch.ones(4 * 2**20); del big
mapped = libc.mallinfo2().hblkhd
blocks = [torch.ones({block_floats}) for _ in range(100)]
held, mapped = resident_mib(), libc.mallinfo2().hblkhd - mapped
del blocks
print(held - resident_mib(), mapped / 2**20)
"""


def _freed_and_mapped_mib(set_it: bool, block_bytes: int = 2 * 2**20) -> tuple[float, float]:
    script = SCRIPT.format(tests=str(Path(__file__).parent), set_it=set_it, block_floats=block_bytes // 4)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    freed, mapped = map(float, out.stdout.split()[-2:])
    return freed, mapped


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc 2.33 and later")
def test_tensors_of_a_mib_and_more_leave_the_resident_set_when_freed():
    # 100 blocks of 2 MiB are 200 MiB; a tensor's block is its bytes plus a page at most, hence the margins
    _, mapped = _freed_and_mapped_mib(False)
    assert mapped < 1, "precondition: without the setting, glibc serves the 2 MiB blocks from its heap"
    freed, mapped = _freed_and_mapped_mib(True)
    assert mapped >= 200, "with the setting, the 2 MiB blocks were not served from mmap"
    assert freed > 150, "the 200 MiB freed stayed resident"
    _, mapped = _freed_and_mapped_mib(True, 768 * 2**10)
    assert mapped < 1, "blocks under MMAP_THRESHOLD_BYTES were mapped"


# a malloc of its own that passes every call to glibc's: what jemalloc or tcmalloc preloaded looks like to the check
PASSTHROUGH_MALLOC = """
#include <stddef.h>
extern void *__libc_malloc(size_t);
void *malloc(size_t n) { return __libc_malloc(n); }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_preloaded_malloc_turns_the_calls_off(tmp_path):
    (tmp_path / "m.c").write_text(PASSTHROUGH_MALLOC)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "m.so"), str(tmp_path / "m.c")], check=True)
    check = "from fasttnt import host_memory; print(host_memory.available(), host_memory.give_back_freed_heap())"

    def run(env):
        out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, env=env)
        return out.stdout.split()

    assert run(os.environ) == ["True", "True"]  # precondition
    assert run({**os.environ, "LD_PRELOAD": str(tmp_path / "m.so")}) == ["False", "False"]


def test_worth_it_by_the_model_size_on_the_cpu(monkeypatch):
    import torch

    model = torch.nn.Linear(64, 64)  # 4,160 float32 parameters: 16,640 bytes
    assert not host_memory.worth_it(model, "cpu"), "precondition: a small model is below the default size"
    monkeypatch.setattr(host_memory, "WORTH_IT_FROM_PARAMETER_BYTES", 16_640)
    assert host_memory.worth_it(model, "cpu") and host_memory.worth_it(model, torch.device("cpu"))
    assert not host_memory.worth_it(model, "cuda")  # CUDA's caching allocator, not malloc
    monkeypatch.setattr(host_memory, "WORTH_IT_FROM_PARAMETER_BYTES", 16_641)
    assert not host_memory.worth_it(model, "cpu")


def test_a_run_applies_both_calls_by_the_model_size(tmp_path, monkeypatch):
    # run_setup.build asks worth_it once: the mmap threshold at setup and the engine's give-back after each rollout
    from support.small import SMALL

    from fasttnt.config import load_config
    from fasttnt.run_setup import build

    calls = []
    monkeypatch.setattr(host_memory, "serve_large_blocks_from_mmap", lambda: calls.append("mmap") or True)
    cfg = load_config(None, [*SMALL, "steps=1", f"cache_dir={tmp_path / 'cache'}"])
    assert not build(cfg, tmp_path / "small").engine.give_back_heap and calls == []
    monkeypatch.setattr(host_memory, "WORTH_IT_FROM_PARAMETER_BYTES", 1)
    assert build(cfg, tmp_path / "large").engine.give_back_heap and calls == ["mmap"]
