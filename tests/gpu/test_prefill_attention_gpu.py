"""CUDA: the naive-form prefill attention kernel (kernels/prefill_attention.py) in bfloat16 at K2's head shapes.

  * against a float64 oracle written out in full (every score at once);
  * bit for bit: a query's output does not depend on the launch it is in: the queries cut into chunks at random
    points (as chunked prefill cuts a prompt) and the keys taken in ranges of random sizes give exactly the rows of
    one launch over everything.
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, P, R, V, C = 8, 128, 64, 128, 512


def _inputs(T: int, start: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    K = start + T
    bf = dict(device="cuda", dtype=torch.bfloat16)
    lat = torch.randn(K, C + R, generator=g, device="cuda").to(torch.bfloat16)
    w_kv = (torch.randn(N * (P + V), C, generator=g, device="cuda") / C ** 0.5).to(torch.bfloat16)
    q_nope = torch.randn(T, N, P, generator=g, device="cuda").to(**bf)
    q_pe = torch.randn(T, N, R, generator=g, device="cuda").to(**bf)
    return lat, w_kv, q_nope, q_pe


def _oracle(q_nope, q_pe, kv, lat, start):
    T = q_nope.shape[0]
    K = start + T
    s = (torch.einsum("tnp,knp->ntk", q_nope.double(), kv[..., :P].double())
         + torch.einsum("tnr,kr->ntk", q_pe.double(), lat[:K, C:].double())) * (P + R) ** -0.5
    future = torch.arange(K, device="cuda")[None, :] > (start + torch.arange(T, device="cuda"))[:, None]
    return torch.einsum("ntk,knv->tnv", s.masked_fill(future, float("-inf")).softmax(-1), kv[..., P:].double())


@pytest.mark.parametrize("T,start", [(1000, 0), (300, 3000)])
def test_prefill_attention_matches_float64(T: int, start: int) -> None:
    from kdtree_engine.kernels.prefill_attention import naive_prefill

    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    lat, w_kv, q_nope, q_pe = _inputs(T, start, seed)
    expand = lambda c: c @ w_kv.T  # noqa: E731
    y = naive_prefill(q_nope, q_pe, lambda a, b: lat[a:b], expand, start, (P + R) ** -0.5, C, V)
    kv = expand(lat[:start + T, :C]).view(-1, N, P + V)
    ref = _oracle(q_nope, q_pe, kv, lat, start)
    rel = float((y.double() - ref).norm() / ref.norm())
    assert rel < 1e-2, f"relative error {rel:.3g} (seed {seed})"


def test_prefill_attention_rows_do_not_depend_on_the_launch(monkeypatch) -> None:
    import kdtree_engine.kernels.prefill_attention as pa

    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    T, start = 2000, 700
    lat, w_kv, q_nope, q_pe = _inputs(T, start, seed)
    # the expansion of a key must not depend on the range it is expanded in: expand the whole cache once and hand
    # out its rows (the engine's kv_b_proj GEMM is batch-invariant; torch's matmul need not be)
    kv_all = (lat[:, :C] @ w_kv.T)
    expand = lambda c: kv_all[_rows[0]:_rows[0] + c.shape[0]]  # noqa: E731
    _rows = [0]

    def latents(a, b):
        _rows[0] = a
        return lat[a:b]

    scale = (P + R) ** -0.5
    whole = pa.naive_prefill(q_nope, q_pe, latents, expand, start, scale, C, V)
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, T, (5,), generator=g).tolist()))
    monkeypatch.setattr(pa, "EXPANDED_BYTES", 3 * pa.BLOCK_N * N * (P + V) * 2)   # 3 key blocks a range
    parts = [pa.naive_prefill(q_nope[a:b], q_pe[a:b], latents, expand, start + a, scale, C, V)
             for a, b in zip([0] + cuts, cuts + [T])]
    got = torch.cat(parts)
    bad = (got != whole).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} differ (cuts {cuts}, seed {seed})"


def test_whole_prompts_in_one_launch_equal_their_own_launches() -> None:
    """Several whole prompts in one launch (naive_prefill_prompts): each prompt's rows bit for bit those of its own
    launch (both read the same expanded keys: the kernel alone is compared)."""
    from kdtree_engine.kernels.prefill_attention import naive_prefill, naive_prefill_prompts
    seed = int(torch.randint(1 << 30, (1,)))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 600, (6,), generator=gen)] + [1, 128, 129]
    lat, w_kv, q_nope, q_pe = _inputs(sum(lengths), 0, seed)
    whole = lat[:, :C] @ w_kv.T     # the keys of every row; a prompt's own launch takes its rows of them
    out = naive_prefill_prompts(q_nope, q_pe, lat, lambda c: whole, lengths, (P + R) ** -0.5, C, V)
    a = 0
    for n in lengths:
        one = naive_prefill(q_nope[a:a + n], q_pe[a:a + n], lambda s0, s1, a=a: lat[a + s0:a + s1],
                            lambda c, a=a, n=n: whole[a:a + n], 0, (P + R) ** -0.5, C, V)
        assert torch.equal(one, out[a:a + n]), f"prompt at row {a} ({n} tokens) differs (seed {seed})"
        a += n
