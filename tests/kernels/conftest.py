"""Kernel-test fixtures: poisoned output buffers and the forced Triton path."""

from __future__ import annotations

import pytest
import torch

from fasttnt_kernels import _common

_POISON_INT = {torch.int32: -(2**31), torch.int64: -(2**63), torch.uint8: 0xAB}


def _poisoned_empty(shape, *, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(_POISON_INT[dtype])


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every kernel output starts as NaN (floats) or a sentinel (ints, 0xAB for bools): an element the kernel
    forgets to write shows up as NaN, as a sentinel, or as a bool byte other than 0/1."""
    monkeypatch.setattr(_common, "new_empty", _poisoned_empty)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv(_common.BACKEND_ENV, "triton")


def pytest_collection_modifyitems(items):
    # Under the interpreter a NaN or inf made anywhere in a kernel, even in a branch tl.where discards, shows up
    # as numpy's RuntimeWarning: make it an error in the kernel tests, so no kernel computes 0 * inf on the side.
    for item in items:
        if "tests/kernels/" in item.path.as_posix():
            item.add_marker(pytest.mark.filterwarnings("error::RuntimeWarning"))
