"""The naive-form prefill attention kernel (kernels/prefill_attention.py) under the interpreter (child process, see
_interp.py), float32, against an independent float64 oracle: causal softmax attention written out in full (scores
[N, T, K] over every key at once, the per-head K / V expanded in one product). Cases cover a whole prompt, a chunk
over a committed prefix, keys taken in several ranges (the state carried between launches), and a query range split
in two (each part's rows equal the whole launch's rows within float32 rounding)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _interp import assert_close, results_fixture  # noqa: E402

# name: (T, start, heads, P, R, V, C, key range in keys: None = one range)
CASES = {
    "prompt_t70": (70, 0, 2, 32, 16, 32, 24, None),
    "chunk_over_prefix": (40, 150, 2, 32, 16, 32, 24, None),
    "key_ranges": (50, 200, 3, 16, 16, 32, 24, 64),
    "split_queries": (130, 30, 2, 32, 16, 16, 24, 128),
    "odd_head_dims": (33, 20, 2, 24, 8, 40, 24, 64),
}
# several whole prompts in one launch (naive_prefill_prompts) == each prompt's own launch, bit for bit
PROMPTS = {"prompts_in_one_launch": ((70, 1, 130, 33, 128), 2, 32, 16, 32, 24)}


def oracle(q_nope, q_pe, lat, w_kv, start, scale, C, V):
    """float64: keys 0..start+T-1 of lat [K, C+R], w_kv [N*(P+V), C] (kv_b_proj), causal."""
    T, N, P = q_nope.shape
    K = start + T
    kv = (lat[:K, :C].double() @ w_kv.double().T).view(K, N, P + V)
    s = (torch.einsum("tnp,knp->ntk", q_nope.double(), kv[..., :P])
         + torch.einsum("tnr,kr->ntk", q_pe.double(), lat[:K, C:].double())) * scale
    future = torch.arange(K)[None, :] > (start + torch.arange(T))[:, None]
    p = s.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("ntk,knv->tnv", p, kv[..., P:])


def _rowwise_expand(w_kv):
    """kv_b_proj as a per-row float64 sum (a row's values whatever rows share the call), rounded to float32."""
    return lambda c: (c.double()[:, None, :] * w_kv.double()[None]).sum(-1).float()


def _run_prompts(spec):
    import kdtree_engine.kernels.prefill_attention as pa

    lengths, N, P, R, V, C = spec
    pa.EXPANDED_BYTES = 256 << 20   # the engine's bound (the other cases set smaller ones)
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    lat = torch.randn(T, C + R, generator=g)
    w_kv = torch.randn(N * (P + V), C, generator=g) / C ** 0.5
    q_nope, q_pe = torch.randn(T, N, P, generator=g), torch.randn(T, N, R, generator=g)
    scale = (P + R) ** -0.5
    expand = _rowwise_expand(w_kv)
    y = pa.naive_prefill_prompts(q_nope, q_pe, lat, expand, list(lengths), scale, C, V)
    equal, rel, a = True, 0.0, 0
    for n in lengths:
        one = pa.naive_prefill(q_nope[a:a + n], q_pe[a:a + n], lambda s0, s1, a=a: lat[a + s0:a + s1], expand, 0,
                               scale, C, V)
        equal &= torch.equal(one, y[a:a + n])
        ref = oracle(q_nope[a:a + n], q_pe[a:a + n], lat[a:a + n], w_kv, 0, scale, C, V)
        rel = max(rel, float((y[a:a + n].double() - ref).norm() / ref.norm()))
        a += n
    return {"seed": seed, "equal": bool(equal), "rel": rel, "nonfinite": int((~y.isfinite()).sum())}


def _run_one(name, spec):
    import kdtree_engine.kernels.prefill_attention as pa

    if name in PROMPTS:
        return _run_prompts(spec)

    T, start, N, P, R, V, C, step = spec
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    K = start + T
    lat = torch.randn(K, C + R, generator=g)
    w_kv = torch.randn(N * (P + V), C, generator=g) / C ** 0.5
    q_nope, q_pe = torch.randn(T, N, P, generator=g), torch.randn(T, N, R, generator=g)
    scale = (P + R) ** -0.5
    if step is not None:
        pa.EXPANDED_BYTES = step * N * (P + V) * 4
    seen = []

    def latents(s0, s1):
        seen.append((s0, s1))
        return lat[s0:s1]

    expand = lambda c: c @ w_kv.T  # noqa: E731
    y = pa.naive_prefill(q_nope, q_pe, latents, expand, start, scale, C, V)
    rec = {"seed": seed, "ranges": list(seen), "ok_meta": y.shape == (T, N, V) and y.dtype == torch.float32,
           "nonfinite": int((~y.isfinite()).sum())}
    ref = oracle(q_nope, q_pe, lat, w_kv, start, scale, C, V)
    rec["rel"] = float((y.double() - ref).norm() / ref.norm())
    if name == "split_queries":   # rows [0, a) and [a, T) in two launches
        a = 77
        y1 = pa.naive_prefill(q_nope[:a], q_pe[:a], latents, expand, start, scale, C, V)
        y2 = pa.naive_prefill(q_nope[a:], q_pe[a:], latents, expand, start + a, scale, C, V)
        rec["split_rel"] = float((torch.cat([y1, y2]).double() - y.double()).abs().max() / y.double().abs().max())
    return rec


interp_results = results_fixture(HERE, list(CASES) + list(PROMPTS))


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_attention_interp(interp_results, name) -> None:
    rec = interp_results[name]
    assert_close(rec, 1e-5)
    T, start, N, P, R, V, C, step = CASES[name]
    # key ranges aligned to multiples of the range size, covering every key once (one range by default)
    step = step or start + T
    assert [tuple(r) for r in rec["ranges"]] == [(s, min(s + step, start + T)) for s in range(0, start + T, step)]
    if "split_rel" in rec:
        assert rec["split_rel"] < 1e-6, f"split launches differ from one launch by {rec['split_rel']:.3g} (seed {rec['seed']})"


def test_prompts_in_one_launch_equal_their_own_launches_interp(interp_results) -> None:
    rec = interp_results["prompts_in_one_launch"]
    print(f"seed {rec.get('seed')}")
    assert "error" not in rec, rec
    assert rec["nonfinite"] == 0
    assert rec["equal"], f"a prompt's rows differ from its own launch (seed {rec['seed']})"
    assert rec["rel"] < 1e-5, f"relative error {rec['rel']:.3g} against float64 (seed {rec['seed']})"


def test_prompts_launch_rejects_what_it_cannot_run() -> None:
    from kdtree_engine.kernels.prefill_attention import naive_prefill_prompts
    q, r, lat = torch.randn(5, 2, 32), torch.randn(5, 2, 16), torch.randn(5, 40)
    with pytest.raises(ValueError, match="do not make"):
        naive_prefill_prompts(q, r, lat, lambda c: c, [2, 2], 1.0, 24, 32)
    with pytest.raises(ValueError, match="more than one key range"):
        naive_prefill_prompts(torch.randn(1 << 17, 2, 32), torch.randn(1 << 17, 2, 16), torch.randn(1 << 17, 40),
                              lambda c: c, [1 << 17], 1.0, 24, 1 << 14)


def test_rejects_bad_shapes() -> None:
    from kdtree_engine.kernels.prefill_attention import naive_prefill
    with pytest.raises(ValueError, match="q_nope"):
        naive_prefill(torch.randn(4, 32), torch.randn(4, 2, 16), lambda a, b: None, lambda c: c, 0, 1.0, 8, 32)


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main
    child_main({**CASES, **PROMPTS}, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
