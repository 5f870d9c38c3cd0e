"""Kernel choice (kernels/dispatch.py) under the kernel policy (kernels/policy.py): batch invariance on by default,
Triton kernels on CUDA only when it is on, torch on the CPU; a forced torch path with invariance on is obeyed and
warned about; the CPU paths of the entries equal their torch formulas. The environment reader (kdtree_engine/env.py)
reads the KDTREE_* variables when called and refuses a bad value by the variable's name."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys

import pytest
import torch

from kdtree_engine.env import VARIABLES, Env, read_env
from kdtree_engine.kernels import dispatch
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.kernels.reference import rms_norm_torch

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here
CPU = torch.device("cpu")


def test_on_by_default() -> None:
    assert KernelPolicy().batch_invariant is True
    assert KernelPolicy.from_env(environ={}).batch_invariant is True
    assert inspect.signature(KernelPolicy.from_env).parameters["batch_invariant"].default is True
    from kdtree_engine.engine import LLM
    assert LLM.__init__.__kwdefaults__["batch_invariant"] is True


def test_backend_choice_follows_invariance() -> None:
    on, off = KernelPolicy(batch_invariant=True), KernelPolicy(batch_invariant=False)
    assert dispatch.dense_backend(on, CUDA) == "triton" and dispatch.attn_backend(on, CUDA) == "triton"
    assert dispatch.dense_backend(on, CPU) == "torch" and dispatch.attn_backend(on, CPU) == "torch"
    assert dispatch.dense_backend(off, CUDA) == "torch" and dispatch.attn_backend(off, CUDA) == "torch"
    # the per-row kernels (tails, row select) and the INT4 / tree kernels do not depend on it
    for p in (on, off):
        assert dispatch.mla_tail_backend(p, CUDA) == "triton" and dispatch.int4_backend(p, CUDA) == "triton"
        assert dispatch.accept_backend(p, CUDA) == "triton" and dispatch.accept_backend(p, CPU) == "torch"


def test_forced_backends_win() -> None:
    p = KernelPolicy(dense="triton", attn="triton", int4="triton", tree="triton")
    assert dispatch.dense_backend(p, CPU) == dispatch.attn_backend(p, CPU) == "triton"
    assert dispatch.int4_backend(p, CPU) == dispatch.accept_backend(p, CPU) == "triton"
    assert dispatch.int4_backend(KernelPolicy(int4="frag"), CPU) == "triton"   # the GPU family; per weight: frag
    t = KernelPolicy(dense="torch", attn="torch", batch_invariant=False)
    assert dispatch.dense_backend(t, CUDA) == dispatch.attn_backend(t, CUDA) == "torch"


def test_forced_torch_with_invariance_warns(monkeypatch, caplog) -> None:
    monkeypatch.setattr(dispatch, "_WARNED", set())
    p = KernelPolicy(attn="torch")
    with caplog.at_level(logging.WARNING, logger="kdtree_engine"):
        assert dispatch.attn_backend(p, CUDA) == "torch"
        dispatch.attn_backend(p, CUDA)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not batch-invariant" in r.message]
    assert len(warnings) == 1  # obeyed, warned once


def test_cpu_paths_equal_torch_formulas() -> None:
    p = KernelPolicy()
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    x = torch.randn(5, 3, 24, generator=g)[..., :17]     # a sliced view, as q_nope is of q
    w = torch.randn(3, 17, 11, generator=g).transpose(1, 2)  # [B, N, K] view of [B, K, N], as W_UK
    torch.testing.assert_close(dispatch.head_matmul(p, x, w), torch.einsum("tbk,bkn->tbn", x, w.transpose(1, 2)))
    h = torch.randn(4, 33, generator=g)
    nw = torch.rand(33, generator=g) + 0.5
    assert torch.equal(dispatch.rms_norm(p, h, nw, 1e-6), rms_norm_torch(h, nw, 1e-6))


def test_training_keeps_torch() -> None:
    """Autograd or autocast active (drafter training): torch runs the op even where Triton would."""
    p = KernelPolicy(dense="triton")  # Triton chosen on the CPU too
    x = torch.randn(3, 8)
    w = torch.randn(5, 8, requires_grad=True)
    y = dispatch.dense_matmul(p, x, w)  # would fail in the Triton kernel without TRITON_INTERPRET
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatch.dense_matmul(p, x, w.detach()).dtype == torch.bfloat16
    assert dispatch.use_triton(p, x, w.detach())
    with torch.no_grad():
        assert dispatch.use_triton(p, x, w)


def test_model_holds_one_policy_and_passes_it_down() -> None:
    from kdtree_engine.config import preset
    from kdtree_engine.model.target import Target

    p = KernelPolicy(batch_invariant=False, attn="torch")
    target = Target(preset("k2-tiny"), policy=p)
    holders = [m for m in target.modules() if hasattr(m, "policy")]
    assert len(holders) > 10 and all(m.policy is p for m in holders)


# ---- the environment reader ------------------------------------------------------------------------------

def test_env_is_read_when_called(monkeypatch) -> None:
    for var in VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert read_env() == Env()
    monkeypatch.setenv("KDTREE_DENSE_BACKEND", "triton")
    monkeypatch.setenv("KDTREE_INT4_BACKEND", "frag")
    assert read_env() == Env(dense_backend="triton", int4_backend="frag")   # the new values, no reload
    assert KernelPolicy.from_env(batch_invariant=False) == KernelPolicy(batch_invariant=False, dense="triton",
                                                                         int4="frag")
    monkeypatch.setenv("KDTREE_DENSE_BACKEND", "")                          # empty: unset
    assert read_env().dense_backend is None
    assert read_env({"KDTREE_TREE_BACKEND": "torch"}) == Env(tree_backend="torch")


@pytest.mark.parametrize("var", sorted(VARIABLES))
def test_bad_value_names_the_variable(var) -> None:
    with pytest.raises(ValueError) as e:
        read_env({var: "cuda-fast"})
    msg = str(e.value)
    assert "\n" not in msg and var in msg and "'cuda-fast'" in msg and "torch" in msg


def test_import_reads_no_variable() -> None:
    """A bad value does not stop the package from importing; the engine's policy construction refuses it."""
    env = dict(os.environ, KDTREE_ATTN_BACKEND="sideways")
    code = ("import kdtree_engine.engine, kdtree_engine.kernels.dispatch\n"
            "from kdtree_engine.kernels.policy import KernelPolicy\n"
            "KernelPolicy.from_env()")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and last.startswith("ValueError: KDTREE_ATTN_BACKEND") and "sideways" in last
    assert "kernels/policy.py" in r.stderr   # raised by the call, not at an import


def test_removed_knobs_are_warned_about_not_read(caplog) -> None:
    """The measurement knobs are gone from the product: set, they change nothing and are named in a warning."""
    gone = ("KDTREE_ROUTER_GEMM", "KDTREE_MOE_SHARED")
    with caplog.at_level(logging.WARNING, logger="kdtree_engine"):
        assert read_env({var: "before" for var in gone}) == Env()
    for var in gone:
        assert var not in VARIABLES
        assert any(var in r.message and "does not read it" in r.message for r in caplog.records), var
