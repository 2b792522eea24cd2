"""The C heap under PyTorch's CPU tensors: what glibc keeps resident after a tensor is freed, and giving it back.

PyTorch's CPU tensors come from ``malloc``. glibc serves a block from ``mmap`` (and unmaps it when freed) only above
its mmap threshold, which starts at 128 KiB and rises with every larger block freed, up to 32 MiB; everything below
can stay in the heap's free lists when freed (glibc trims only the heap's top by itself): resident, counted in the
process's memory, and reusable only by allocations that fit. A rollout frees thousands of small and medium blocks
(each step's logits, a KV cache grown by concatenation) and an update's layers allocate and free activations of
tens of MiB. At the 0.5B shape at 512 tokens the update started 310 MiB lower with both calls than without
(``benchmarks/RESULTS.md``); at the embedded default's tiny model they cost a sixth of its steps/s and saved
67 MiB, so a run applies them only to a model of ``WORTH_IT_FROM_PARAMETER_BYTES`` and more (docs/design.md).
Linux with glibc's own malloc only; elsewhere (another C library, or jemalloc or tcmalloc preloaded) both calls do
nothing and return False.
"""

from __future__ import annotations

import ctypes
import functools

import torch

MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of 1 MiB and more come from mmap and go back to the system when freed. The costs of the mapping (a system
call and the first touch of each page) are small beside what a block that size holds: a decode step's logits at V =
151,936 are 4.6 MiB for 8 rows; at the 0.5B shape the generation phase took the same time with it as without, within
the runs' spread."""

WORTH_IT_FROM_PARAMETER_BYTES = 256 * 2**20
"""The trainer applies the CPU's memory measures to a model whose parameters take this many bytes or more
(``worth_it``): both calls below, and ``policy.tied_rows_into_grad``. What they save grows with the model (its
activations, a rollout's logits and KV caches, the (V, H) of a tied embedding); what they cost (a page fault on
every first touch of a block given back, each step; a row-by-row ``index_add_``) is at a small model a share of the
step that saves nothing that matters."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.cache
def _libc():
    """glibc, where its malloc is the process's; else None (musl, macOS, Windows, an allocator preloaded)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    address = ctypes.cast  # the malloc the process calls (a preloaded one comes first) against glibc's own
    if address(ctypes.CDLL(None).malloc, ctypes.c_void_p).value != address(libc.malloc, ctypes.c_void_p).value:
        return None
    return libc


def available() -> bool:
    """Whether the calls below take effect here (glibc's own malloc)."""
    return _libc() is not None


def worth_it(model, device) -> bool:
    """Whether a run on ``device`` with ``model`` applies the CPU's memory measures: on the CPU, for parameters of
    at least ``WORTH_IT_FROM_PARAMETER_BYTES`` (where malloc is not glibc's, the two calls below then do nothing)."""
    if torch.device(device).type != "cpu":
        return False
    return sum(p.numel() * p.element_size() for p in model.parameters()) >= WORTH_IT_FROM_PARAMETER_BYTES


def serve_large_blocks_from_mmap() -> bool:
    """Set glibc's mmap threshold to ``MMAP_THRESHOLD_BYTES`` (fixed: no longer rising), so that freed tensors of
    that size and more leave the resident set at once; False where there is no glibc. Process-wide and for the
    process's life: the CPU trainer calls it at setup."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def give_back_freed_heap() -> bool:
    """Return the heap's free memory to the system (``malloc_trim(0)``, which walks the free lists: milliseconds);
    False where there is no glibc. Called at the end of a rollout on the CPU, before the update allocates."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
