"""Which path an op takes: Triton on CUDA, PyTorch ops elsewhere, FASTTNT_KERNELS to force either."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import fasttnt_kernels
from fasttnt_kernels import _common, token_logprobs

# the module (the package's attribute of that name is the function)
token_logprobs_module = importlib.import_module("fasttnt_kernels.token_logprobs")


def _path_taken(monkeypatch, logits) -> list[str]:
    """The forward launchers token_logprobs called on ``logits``, as "triton" or "torch" (each spied on, then run)."""
    taken = []
    for name, path in (("token_logprobs_forward", "triton"), ("token_logprobs_forward_torch", "torch")):
        launch = getattr(token_logprobs_module, name)

        def spy(*args, _launch=launch, _path=path, **kwargs):
            taken.append(_path)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(token_logprobs_module, name, spy)
    x = logits.clone().requires_grad_()
    token_logprobs(x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
    return taken


def test_cpu_tensors_take_the_pytorch_path_by_default(monkeypatch):
    monkeypatch.delenv(_common.BACKEND_ENV, raising=False)
    assert _path_taken(monkeypatch, torch.randn(2, 5)) == ["torch"]
    assert not _common.use_triton(torch.zeros(1))


def test_forcing_either_path(monkeypatch):
    # Triton runs CPU tensors only under its interpreter, which conftest.py sets where there is no CUDA; with CUDA
    # the kernels are compiled, and forced Triton needs CUDA tensors
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv(_common.BACKEND_ENV, "triton")
    assert _path_taken(monkeypatch, torch.randn(2, 5, device=device)) == ["triton"]
    monkeypatch.setenv(_common.BACKEND_ENV, "torch")
    assert _path_taken(monkeypatch, torch.randn(2, 5, device=device)) == ["torch"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_triton_path_by_default(monkeypatch):
    monkeypatch.delenv(_common.BACKEND_ENV, raising=False)
    assert _path_taken(monkeypatch, torch.randn(2, 5, device="cuda")) == ["triton"]


def test_unknown_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv(_common.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="FASTTNT_KERNELS='cuda'"):
        token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long))


def test_forced_triton_on_cpu_without_the_interpreter_explains(monkeypatch):
    monkeypatch.setenv(_common.BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _common.use_triton(torch.zeros(1))


def test_mixed_devices_are_rejected():
    meta = torch.zeros(2, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="one device"):
        token_logprobs(torch.randn(2, 5), meta)


def test_public_api():
    for name in (
        "token_logprobs",
        "linear_token_logprobs",
        "group_advantages",
        "mode_advantages",
        "clipped_policy_loss",
        "tnt_rewards",
    ):
        assert callable(getattr(fasttnt_kernels, name))
        assert callable(getattr(fasttnt_kernels, name + "_reference"))
        assert name in fasttnt_kernels.__all__


def test_import_has_no_side_effects():
    # a fresh interpreter: importing the package must not touch the environment, CUDA, or torch's global state
    code = (
        "import os, torch; before = dict(os.environ); dtype = torch.get_default_dtype();"
        "import fasttnt_kernels;"
        "assert dict(os.environ) == before, 'environment changed';"
        "assert torch.get_default_dtype() == dtype;"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
