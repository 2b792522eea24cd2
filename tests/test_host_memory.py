"""fasttnt.host_memory: freed tensors leave the resident set (glibc on Linux), in a fresh interpreter each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small import glibc_on_linux

from fasttnt import host_memory

pytestmark = pytest.mark.skipif(not glibc_on_linux(), reason="glibc's malloc on Linux")

# A 16 MiB block freed raises glibc's dynamic mmap threshold to 16 MiB, as a model's loading, a rollout's and an
# update's freed blocks do (before the setting and after it: the setting must fix the threshold at 1 MiB, where
# setting another of mallopt's parameters would freeze it at 16 MiB); then blocks (2 MiB unless said), touched, each
# followed by a small block kept alive (so that the freed ones cannot merge into the top of the heap, which glibc
# trims by itself): without the setting they come from the heap and stay resident when freed
SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from small import resident_mib
from fasttnt import host_memory
big = torch.ones(4 * 2**20); del big  # before the setting too, as a model's loading frees large blocks
if {set_it}:
    assert host_memory.serve_large_blocks_from_mmap()
big = torch.ones(4 * 2**20); del big
blocks, kept = [], []
for _ in range(100):
    blocks.append(torch.ones({block_floats}))
    kept.append(torch.ones(1024))  # 4 KiB
held = resident_mib()
del blocks
print(held - resident_mib())
"""


def _freed_mib(set_it: bool, block_bytes: int = 2 * 2**20) -> float:
    script = SCRIPT.format(tests=str(Path(__file__).parent), set_it=set_it, block_floats=block_bytes // 4)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def test_tensors_of_a_mib_and_more_leave_the_resident_set_when_freed():
    assert _freed_mib(False) < 50, "precondition: without the setting, glibc keeps the freed 2 MiB blocks"
    assert _freed_mib(True) > 150, "the 200 MiB freed stayed resident"
    assert _freed_mib(True, 768 * 2**10) < 25, "blocks under MMAP_THRESHOLD_BYTES were mapped"


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
    from small import SMALL

    from fasttnt.config import load_config
    from fasttnt.run_setup import build

    calls = []
    monkeypatch.setattr(host_memory, "serve_large_blocks_from_mmap", lambda: calls.append("mmap") or True)
    cfg = load_config(None, [*SMALL, "steps=1", f"cache_dir={tmp_path / 'cache'}"])
    assert not build(cfg, tmp_path / "small").engine.give_back_heap and calls == []
    monkeypatch.setattr(host_memory, "WORTH_IT_FROM_PARAMETER_BYTES", 1)
    assert build(cfg, tmp_path / "large").engine.give_back_heap and calls == ["mmap"]
