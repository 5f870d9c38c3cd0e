"""Kernel choice (kernels/dispatch.py): batch invariance on by default, Triton kernels on CUDA only
when it is on, torch on the CPU; a forced torch path with invariance on is obeyed and warned about;
the CPU paths of the new entries equal their torch formulas."""

from __future__ import annotations

import logging

import pytest
import torch

from kdtree_engine.kernels import dispatch
from kdtree_engine.model.layers import rms_norm_torch

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here
CPU = torch.device("cpu")


@pytest.fixture
def restore_invariance():
    prev = dispatch.batch_invariant()
    yield
    dispatch.set_batch_invariant(prev)


def test_on_by_default() -> None:
    import importlib
    import subprocess
    import sys

    code = "from kdtree_engine.kernels import dispatch; print(dispatch.batch_invariant())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
    assert importlib.import_module("kdtree_engine.engine").LLM.__init__.__kwdefaults__["batch_invariant"] is True


def test_backend_choice_follows_invariance(restore_invariance, monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "_DENSE_FORCED", None)
    monkeypatch.setattr(dispatch, "_ATTN_FORCED", None)
    dispatch.set_batch_invariant(True)
    assert dispatch.dense_backend(CUDA) == "triton" and dispatch.attn_backend(CUDA) == "triton"
    assert dispatch.dense_backend(CPU) == "torch" and dispatch.attn_backend(CPU) == "torch"
    dispatch.set_batch_invariant(False)
    assert dispatch.dense_backend(CUDA) == "torch" and dispatch.attn_backend(CUDA) == "torch"


def test_forced_torch_with_invariance_warns(restore_invariance, monkeypatch, caplog) -> None:
    monkeypatch.setattr(dispatch, "_ATTN_FORCED", "torch")
    monkeypatch.setattr(dispatch, "_WARNED", set())
    dispatch.set_batch_invariant(True)
    with caplog.at_level(logging.WARNING, logger="kdtree_engine"):
        assert dispatch.attn_backend(CUDA) == "torch"
        dispatch.attn_backend(CUDA)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not batch-invariant" in r.message]
    assert len(warnings) == 1  # obeyed, warned once


def test_cpu_paths_equal_torch_formulas() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    x = torch.randn(5, 3, 24, generator=g)[..., :17]     # a sliced view, as q_nope is of q
    w = torch.randn(3, 17, 11, generator=g).transpose(1, 2)  # [B, N, K] view of [B, K, N], as W_UK
    torch.testing.assert_close(dispatch.head_matmul(x, w), torch.einsum("tbk,bkn->tbn", x, w.transpose(1, 2)))
    h = torch.randn(4, 33, generator=g)
    nw = torch.rand(33, generator=g) + 0.5
    assert torch.equal(dispatch.rms_norm(h, nw, 1e-6), rms_norm_torch(h, nw, 1e-6))


def test_training_keeps_torch(restore_invariance, monkeypatch) -> None:
    """Autograd or autocast active (drafter training): torch runs the op even where Triton would."""
    monkeypatch.setattr(dispatch, "_DENSE_FORCED", "triton")  # Triton chosen on the CPU too
    x = torch.randn(3, 8)
    w = torch.randn(5, 8, requires_grad=True)
    y = dispatch.dense_matmul(x, w)  # would fail in the Triton kernel without TRITON_INTERPRET
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatch.dense_matmul(x, w.detach()).dtype == torch.bfloat16
    assert dispatch._use_triton(x, w.detach())
    with torch.no_grad():
        assert dispatch._use_triton(x, w)
