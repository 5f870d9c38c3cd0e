"""Router tail: the torch path (model/moe.py route_torch) equals the numpy reference's router with its
stable-sort tie rule; the Triton kernel (kernels/router.py) under the interpreter (child process, see
_interp.py) picks the same experts as the torch path, ties included, with weights within a few ulps,
and a row's result does not depend on the rows sharing the launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine import reference  # noqa: E402
from kdtree_engine.config import preset  # noqa: E402
from kdtree_engine.kernels import dispatch  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.kernels.reference import route_torch  # noqa: E402


def _cfg(E: int, k: int, G: int, tg: int, norm: bool = True, scale: float = 2.5):
    return preset("k2-tiny").replace(n_routed_experts=E, num_experts_per_tok=k, n_group=G, topk_group=tg,
                                     norm_topk_prob=norm, routed_scaling_factor=scale)


def _numpy_route(cfg, logits: torch.Tensor, bias: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """reference.route with the logits given: x = logits, gate weight = identity."""
    E = logits.shape[1]
    w = {"gate.weight": np.eye(E, dtype=np.float32), "gate.e_score_correction_bias": bias.numpy()}
    return reference.route(cfg, w, "", logits.numpy())


def _tied_inputs(gen: torch.Generator, T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits from a 3-value set and a 2-value bias: many exactly equal choices (and group scores)."""
    logits = torch.tensor([-0.5, 0.25, 1.0])[torch.randint(0, 3, (T, E), generator=gen)]
    bias = torch.tensor([0.0, 0.125])[torch.randint(0, 2, (E,), generator=gen)]
    return logits, bias


@pytest.mark.parametrize("E,k,G,tg", [(8, 2, 1, 1), (24, 3, 1, 1), (64, 6, 8, 3), (20, 4, 4, 2)])
@pytest.mark.parametrize("tied", [False, True])
def test_torch_path_matches_reference(E, k, G, tg, tied) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(E, k, G, tg)
    if tied:
        logits, bias = _tied_inputs(gen, 11, E)
    else:
        logits, bias = torch.randn(11, E, generator=gen) * 2, torch.randn(E, generator=gen) * 0.1
    ids, w = route_torch(logits, bias, cfg)
    rids, rw = _numpy_route(cfg, logits, bias)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert np.array_equal(ids.numpy(), rids), f"seed {seed}"
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-6, atol=0, err_msg=f"seed {seed}")


def test_ties_go_to_the_lower_index() -> None:
    cfg = _cfg(8, 3, 1, 1)
    logits = torch.zeros(2, 8)
    logits[1, [2, 5, 6]] = 1.0  # three equal winners, then ties among the rest
    ids, w = route_torch(logits, torch.zeros(8), cfg)
    assert ids.tolist() == [[0, 1, 2], [2, 5, 6]]
    g = _cfg(8, 2, 4, 2)  # groups {0,1} {2,3} {4,5} {6,7}: all tie -> groups 0 and 1 -> experts 0, 1
    assert route_torch(torch.zeros(1, 8), torch.zeros(8), g)[0].tolist() == [[0, 1]]


def test_dispatch_cpu_is_torch_path() -> None:
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cfg = _cfg(16, 4, 4, 2)
    logits, bias = torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen) * 0.1
    a, b = dispatch.route(KernelPolicy(), logits, bias, cfg), route_torch(logits, bias, cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dispatch_cpu_owned_routes_are_the_torch_form() -> None:
    """Off CUDA the router tail's expert-parallel routes are parallel/experts.py's on its global routes: owned ids
    made local, the others -1 with weight 0 (fresh random logits)."""
    from kdtree_engine.parallel.experts import NOT_OWNED
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    cfg, owned = _cfg(32, 4, 4, 2), range(8, 16)
    logits, bias = torch.randn(6, 32, generator=gen), torch.randn(32, generator=gen) * 0.1
    (lid, lw), (ids, w) = dispatch.route(KernelPolicy(), logits, bias, cfg, owned), route_torch(logits, bias, cfg)
    mine = (ids >= 8) & (ids < 16)
    assert torch.equal(lid, torch.where(mine, ids - 8, torch.full_like(ids, NOT_OWNED)))
    assert torch.equal(lw, torch.where(mine, w, torch.zeros_like(w)))


def test_torch_path_sums_split_partials_in_order() -> None:
    """Split-K partials [S, T, E] (the router kernel's, router_matmul partials=True): the torch path adds them in
    split order first, the bits of the logits split_sum writes."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cfg = _cfg(24, 3, 4, 2)
    parts, bias = torch.randn(5, 7, 24, generator=gen), torch.randn(24, generator=gen) * 0.1
    logits = ((((parts[0] + parts[1]) + parts[2]) + parts[3]) + parts[4])
    a, b = route_torch(parts, bias, cfg), route_torch(logits, bias, cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    a = route_torch(parts[:1], bias, cfg)
    assert torch.equal(a[0], route_torch(parts[0], bias, cfg)[0])


def test_rejects_bad_inputs() -> None:
    from kdtree_engine.kernels.router import route_triton
    with pytest.raises(ValueError, match="S >= 1"):
        route_triton(torch.zeros(0, 2, 8), torch.zeros(8), 2, 1, 1, True, 1.0)
    with pytest.raises(TypeError):
        route_triton(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError):
        route_triton(torch.zeros(2, 8), torch.zeros(8), 2, 3, 1, True, 1.0)  # 8 % 3
    with pytest.raises(ValueError):
        route_triton(torch.zeros(2, 8), torch.zeros(8), 9, 1, 1, True, 1.0)  # k > E


# ---------------------------------------------------------------------------------- interpreter

# name: (T, E, k, n_group, topk_group, norm_topk_prob, inputs)
CASES = {
    "demo_t5_e8_k2": (5, 8, 2, 1, 1, True, "randn"),
    "t7_e24_k3_nonorm": (7, 24, 3, 1, 1, False, "randn"),
    "grouped_t9_e64_k6_g8_tg3": (9, 64, 6, 8, 3, True, "randn"),
    "grouped_t3_e20_k4_g4_tg2": (3, 20, 4, 4, 2, True, "randn"),
    "ties_t13_e8_k2": (13, 8, 2, 1, 1, True, "tied"),
    "ties_t13_e24_k5": (13, 24, 5, 1, 1, True, "tied"),
    "ties_grouped_t13_e32_k4_g4_tg2": (13, 32, 4, 4, 2, True, "tied"),
    "inv_t65_e40_k8_g5_tg2": (65, 40, 8, 5, 2, True, "invariance"),
    # split-K partials [3, T, E] (strided rows) summed in the kernel: the bits of the kernel on their in-order sum
    "splits_t9_e64_k6_g8_tg3": (9, 64, 6, 8, 3, True, "splits"),
    # expert parallel: the router tail making a random rank's routes its own == the torch form bit for bit;
    # 65 x 8 routes span three programs of the launch
    "owned_t9_e64_k6_g8_tg3": (9, 64, 6, 8, 3, True, "owned"),
    "owned_t65_e40_k8_g5_tg2": (65, 40, 8, 5, 2, True, "owned"),
}
MAX_ULPS = 8  # weights: numpy's exp in the sigmoid vs torch's, and the k-term sum's order (k > 2)


def _run_one(name, spec):
    from kdtree_engine.kernels.router import route_triton

    T, E, k, G, tg, norm, kind = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(E, k, G, tg, norm)
    if kind == "tied":
        logits, bias = _tied_inputs(gen, T, E)
    elif kind == "splits":
        parts = torch.randn(3, T, 2 * E, generator=gen)[:, :, ::2]
        logits = (parts[0] + parts[1]) + parts[2]
        bias = torch.randn(E, generator=gen) * 0.1
    else:
        logits = torch.randn(T, 2 * E, generator=gen)[:, ::2] * 2  # strided rows: a view of a wider tensor
        bias = torch.randn(E, generator=gen) * 0.1
    ids, w = route_triton(logits, bias, k, G, tg, norm, cfg.routed_scaling_factor)
    rids, rw = route_torch(logits.contiguous(), bias, cfg)
    ulp = torch.finfo(torch.float32).eps * rw.double().abs().clamp_min(1e-30)
    rec = {"seed": seed, "meta": ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k),
           "nonfinite": int((~torch.isfinite(w)).sum()), "ids_equal": bool(torch.equal(ids, rids)),
           "ulps": float(((w.double() - rw.double()).abs() / ulp).max()), "bad": []}
    if kind == "splits":
        a = route_triton(parts, bias, k, G, tg, norm, cfg.routed_scaling_factor)
        if not (torch.equal(a[0], ids) and torch.equal(a[1], w)):
            rec["bad"].append("the partials' launch differs from the launch on their in-order sum")
    if kind == "owned":
        from kdtree_engine.parallel.experts import owned_routes
        ranks = int(torch.randint(2, 9, (1,), generator=gen))
        per = -(-E // ranks)
        for r in range(ranks):
            owned = range(r * per, min((r + 1) * per, E))
            want = owned_routes(ids, w, owned)
            tail = route_triton(logits, bias, k, G, tg, norm, cfg.routed_scaling_factor, owned)
            if not (torch.equal(tail[0], want[0]) and torch.equal(tail[1], want[1])):
                rec["bad"].append(f"rank {r} of {ranks}: the router tail's own routes differ")
    if kind == "invariance":
        for i in (0, 1, 31, 64):
            a = route_triton(logits[i:i + 1], bias, k, G, tg, norm, cfg.routed_scaling_factor)
            if not (torch.equal(a[0][0], ids[i]) and torch.equal(a[1][0], w[i])):
                rec["bad"].append(f"row {i}: T=1 != T={T}")
        for m in (2, 17):
            a = route_triton(logits[:m], bias, k, G, tg, norm, cfg.routed_scaling_factor)
            if not (torch.equal(a[0], ids[:m]) and torch.equal(a[1], w[:m])):
                rec["bad"].append(f"T={m} != T={T} on shared rows")
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.assert_ulps(rec, "the torch path (ids / weights)", {"ulps": MAX_ULPS})
    assert rec["ids_equal"], f"experts differ from the torch path (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
