"""Fragment-ordered W4A16 kernels (Gluon; kernels/w4_frag.py, kernels/moe_frag.py) on CUDA.

Inputs are fresh random words (all 16 nibble values) and scales in [0.01, 0.1], repacked with
frag_repack; every buffer the wrappers allocate is poisoned (NaN / -77777). Oracles: x @ W^T in fp32 with
W dequantized from the original (not repacked) words, and fused_moe_reference."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="Gluon kernels do not run in the interpreter"),
]

from kdtree_engine.kernels.moe_frag import FragMoEConfig, fused_moe_frag  # noqa: E402
from kdtree_engine.kernels.moe_w4a16 import fused_moe_reference  # noqa: E402
from kdtree_engine.kernels.layouts import frag_gpb, frag_repack, frag_tile, scale_tile  # noqa: E402
from kdtree_engine.kernels.w4_frag import HAVE_GLUON, DenseLaunch, dense_launch, frag_linear  # noqa: E402
from kdtree_engine.quant import dequantize  # noqa: E402

from tests.gpu.test_kernels_gpu import _check, poisoned, rand_w4, rel  # noqa: E402,F401

if not HAVE_GLUON:
    pytestmark.append(pytest.mark.skip(reason="triton without gluon"))

G = 32
TOL = 1e-2


def _launch(x: torch.Tensor, N: int, K: int, **fields) -> DenseLaunch:
    """The engine's launch of x @ W^T for an [N, K] weight with some fields replaced (another partition, token
    tile, MMA or word / scale order)."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return replace(dense_launch(x.shape[0], N, K, sms), **fields)


@pytest.mark.parametrize("N,K,split", [
    (192, 512, 1), (256, 768, 3), (4096, 7168, 4), (7168, 2048, 2), (512, 1024, 2), (128, 512, 1),
])
@pytest.mark.parametrize("M", [1, 3, 8, 13, 16, 37])
def test_frag_linear_matches_reference(poisoned, N, K, split, M):
    """The engine's launch and tile-aligned K splits (programs = row tiles x split) against x @ W^T."""
    p, s = rand_w4(N, K)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = (x.float() @ dequantize(p, s, G, torch.bfloat16).float().T).to(torch.bfloat16)
    q = frag_repack(p, frag_gpb(K))
    _check(frag_linear(x, q, s), ref, TOL, f"frag plan N={N} K={K} M={M}")
    out = frag_linear(x, q, s, launch=_launch(x, N, K, programs=(N // 64) * split))
    _check(out, ref, TOL, f"frag N={N} K={K} M={M} split={split}")


@pytest.mark.parametrize("N,K,programs", [(2048, 7168, 100), (2048, 7168, 37), (192, 512, 5), (1024, 2048, 7),
                                          (36864, 7168, None)])
def test_frag_linear_stream_partition(poisoned, N, K, programs):
    """Stream partitions whose program ranges cut row tiles inside (up to 7 partials per tile; tiles with fewer
    segments zero their unused slots; segments of odd and even block counts): x @ W^T, and a row's bits equal
    the M = 37 launch at every token tile and MMA (the partition alone sets the reduction)."""
    p, s = rand_w4(N, K)
    gpb = frag_gpb(K)
    q = frag_tile(frag_repack(p, gpb), gpb, 64)
    x = torch.randn(37, K, device="cuda").to(torch.bfloat16)
    ref = (x.float() @ dequantize(p, s, G, torch.bfloat16).float().T).to(torch.bfloat16)
    fields = dict(tile=64) if programs is None else dict(tile=64, programs=programs)
    full = frag_linear(x, q, s, launch=_launch(x, N, K, **fields))
    _check(full, ref, TOL, f"frag stream N={N} K={K} programs={programs}")
    if programs is None:   # the engine's own launch
        assert torch.equal(frag_linear(x, q, s, tile=64), full)
    bad = []
    for tok, mma in ((8, "sync"), (16, "sync"), (8, "wgmma"), (16, "wgmma"), (32, "wgmma"), (64, "wgmma")):
        for m in (1, 5, 16, 37):
            rows = frag_linear(x[:m], q, s, launch=_launch(x, N, K, tok=tok, mma=mma, **fields))
            if not torch.equal(rows, full[:m]):
                bad.append((tok, mma, m, int((rows != full[:m]).sum())))
    assert not bad, f"rows differ from the M=37 launch (tok, mma, M, #elements): {bad}"


def test_frag_linear_detects_unrepacked_words():
    """The kernel reads the fragment order: the original words give a wrong result (the repack matters)."""
    p, s = rand_w4(256, 1024)
    x = torch.randn(4, 1024, device="cuda").to(torch.bfloat16)
    ref = x.float() @ dequantize(p, s, G, torch.bfloat16).float().T
    assert rel(frag_linear(x, p, s), ref) > 0.5


@pytest.mark.parametrize("split", [None, 1, 4])
def test_frag_linear_batch_invariant(split):
    """The engine's launches (mma.sync and wgmma programs by M) on the plan's partition and tile-aligned splits: a
    row's bits do not depend on M."""
    p, s = rand_w4(4096, 7168)
    q = frag_repack(p, 8)
    x = torch.randn(100, 7168, device="cuda").to(torch.bfloat16)
    fields = {} if split is None else dict(programs=64 * split)   # 64 row tiles of 64 rows
    full = frag_linear(x, q, s, launch=_launch(x, 4096, 7168, **fields))
    bad = [(m, int((frag_linear(x[:m], q, s, launch=_launch(x[:m], 4096, 7168, **fields)) != full[:m]).sum()))
           for m in (1, 2, 5, 8, 9, 16, 17, 64)]
    bad = [b for b in bad if b[1]]
    assert not bad, f"rows differ from the M=100 launch (M, #elements): {bad}"


@pytest.mark.parametrize("N,K,split", [(2048, 7168, 4), (192, 2048, 1), (128, 256, 1)])
def test_frag_linear_tiled_words_same_bits(poisoned, N, K, split):
    """Words in frag_tile's order (each block of 64 rows contiguous, a row's words of a block chunk-major) read
    through TILE: the same values into the same MMAs, the same bits as row-major, at 8 / 16-token tiles."""
    p, s = rand_w4(N, K)
    q = frag_repack(p, 8)
    qt = frag_tile(q, 8, 64)
    assert not torch.equal(qt, q), "tiling moved nothing (8 groups per block: the chunk order moves every row)"
    assert torch.equal(frag_tile(qt, 8, 64, inverse=True), q)
    for M in (1, 13, 37):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        for tok in (8, 16):
            launch = _launch(x, N, K, programs=(N // 64) * split, tok=tok, mma="sync")
            rows = frag_linear(x, q, s, launch=launch)
            tiled = frag_linear(x, qt, s, launch=replace(launch, tile=64))
            assert torch.equal(rows, tiled), f"tiled words: other bits (tok {tok} M {M})"


@pytest.mark.parametrize("N,K,split,tile", [(192, 512, 1, 0), (4096, 7168, 4, 64), (7168, 2048, 2, 64),
                                            (128, 256, 1, 64)])
@pytest.mark.parametrize("M", [1, 3, 16, 37, 64])
def test_frag_linear_wgmma_matches_reference(poisoned, N, K, split, tile, M):
    """wgmma programs (dequantized weights the register A operand, activations the shared-memory B operand)
    against x @ W^T, at every token tile (programs of 1, 2, 4 and 7 K blocks)."""
    p, s = rand_w4(N, K)
    gpb = frag_gpb(K)
    q = frag_repack(p, gpb)
    if tile:
        q = frag_tile(q, gpb, tile)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = (x.float() @ dequantize(p, s, G, torch.bfloat16).float().T).to(torch.bfloat16)
    for tok in (8, 16, 32, 64):
        out = frag_linear(x, q, s, launch=_launch(x, N, K, programs=(N // 64) * split, tok=tok, mma="wgmma",
                                                  tile=tile))
        _check(out, ref, TOL, f"frag wgmma N={N} K={K} M={M} tok={tok}")


@pytest.mark.parametrize("split", [1, 2])
def test_frag_linear_wgmma_batch_invariant(split):
    """wgmma programs of 8 / 16 / 32 / 64 tokens (instructions m64n8 .. m64n64): a row's bits do not depend
    on the token tile, on the other rows of the launch or on the instruction (mma.sync gives them too)."""
    p, s = rand_w4(2048, 7168)
    q = frag_tile(frag_repack(p, 8), 8, 64)
    x = torch.randn(100, 7168, device="cuda").to(torch.bfloat16)
    fields = dict(programs=32 * split, tile=64)   # 32 row tiles of 64 rows
    full = frag_linear(x, q, s, launch=_launch(x, 2048, 7168, tok=64, mma="wgmma", **fields))
    bad = []
    for tok in (8, 16, 32, 64):
        for m in (1, 5, 16, 17, 64, 100):
            rows = frag_linear(x[:m], q, s, launch=_launch(x, 2048, 7168, tok=tok, mma="wgmma", **fields))
            if not torch.equal(rows, full[:m]):
                bad.append((tok, m, int((rows != full[:m]).sum())))
    assert not bad, f"rows differ from the M=100 launch (tok, M, #elements): {bad}"
    # mma.sync programs of 16 tokens: the same bits (the engine's launch takes either by the token count)
    sync = frag_linear(x, q, s, launch=_launch(x, 2048, 7168, tok=16, mma="sync", **fields))
    assert torch.equal(sync, full), f"wgmma vs mma.sync: {int((sync != full).sum())} elements differ"


def test_int4_linear_module_takes_fragment_kernel(poisoned):
    """An INT4 Linear on CUDA with bfloat16 activations runs the fragment kernel by default (its words put in
    engine order in place, once): right values, and the rows of every M (mma.sync and wgmma programs) equal
    the M = 130 forward bit for bit."""
    from kdtree_engine.model.int4_order import FRAG, order_of
    from kdtree_engine.model.layers import Linear
    p, s = rand_w4(1024, 2048)
    lin = Linear(2048, 1024, group_size=G, dtype=torch.bfloat16).cuda()
    lin.weight_packed.copy_(p)
    lin.weight_scale.copy_(s)
    x = torch.randn(130, 2048, device="cuda").to(torch.bfloat16)
    full = lin(x)
    assert order_of(lin) == FRAG
    ref = (x.float() @ dequantize(p, s, G, torch.bfloat16).float().T).to(torch.bfloat16)
    _check(full, ref, TOL, "INT4 Linear M=130")
    bad = [m for m in (1, 8, 9, 16, 17, 32, 33, 64, 70) if not torch.equal(lin(x[:m]), full[:m])]
    assert not bad, f"rows differ from the M=130 forward at M = {bad}"


def _moe_case(E, H, I, T, topk, gpb=None, seed=0, unowned=False, share=None):
    """share: the chance that a route is this rank's (expert parallel); the others are -1."""
    torch.manual_seed(seed)
    w13p, w13s = rand_w4(E, 2 * I, H)
    w2p, w2s = rand_w4(E, H, I)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(topk, dim=1).indices
    if unowned:   # pairs routed to experts of another rank
        ids[::2, 3] = -1
    if share is not None:
        ids[torch.rand(T, topk, device="cuda") >= share] = -1
    tw = torch.rand(T, topk, device="cuda")
    tw = tw / tw.sum(1, keepdim=True)
    ref = fused_moe_reference(x, w13p, w13s, w2p, w2s, ids, tw, G)
    g13, g2 = (gpb, gpb) if gpb else (frag_gpb(H), frag_gpb(I))
    return x, (frag_repack(w13p, g13), w13s, frag_repack(w2p, g2), w2s), ids, tw, ref


@pytest.mark.parametrize("cfg", [None, FragMoEConfig(BLOCK_M=16, P13=5, P2=7), FragMoEConfig(GPB=4, P13=9, P2=5),
                                 FragMoEConfig(BLOCK_M=8, P13=9, P2=4), FragMoEConfig(BLOCK_M=32),
                                 FragMoEConfig(BLOCK_M=64, P13=5, P2=7), FragMoEConfig(BLOCK_M=32, P13=9, P2=4)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_moe_frag_matches_reference_small(poisoned, cfg, T):
    """Odd stream partitions (P13 / P2 programs per expert block: partials of up to 3 programs per tile, up to 4
    tiles per program) on mma.sync and wgmma blocks against the torch reference."""
    x, w, ids, tw, ref = _moe_case(E=12, H=1024, I=512, T=T, topk=3, gpb=cfg and cfg.GPB, seed=T)
    _check(fused_moe_frag(x, *w, ids, tw, G, cfg), ref, TOL, f"moe frag T={T} {cfg}")


@pytest.mark.parametrize("T", [1, 7, 40])
def test_moe_frag_demo_shapes(poisoned, T):
    """The demo's experts (H 256, I 192: 2 groups per block on w2)."""
    x, w, ids, tw, ref = _moe_case(E=8, H=256, I=192, T=T, topk=2, seed=T)
    for cfg in (None, FragMoEConfig(BLOCK_M=16, P13=3, P2=5)):
        _check(fused_moe_frag(x, *w, ids, tw, G, cfg), ref, TOL, f"moe frag demo shapes T={T} {cfg}")


def test_moe_frag_k2_and_unowned_experts(poisoned):
    """K2 shapes (a slice of 48 experts; the engine's partitions: gate/up 3 partials per tile, down whole tiles),
    with some pairs routed to experts of another rank (-1)."""
    x, w, ids, tw, ref = _moe_case(E=48, H=7168, I=2048, T=9, topk=8, unowned=True)
    _check(fused_moe_frag(x, *w, ids, tw, G), ref, TOL, "moe frag K2 slice")


@pytest.mark.parametrize("T", [1, 3, 16])
def test_moe_frag_planned_for_one_local_route(poisoned, T):
    """An expert-parallel rank plans its programs for its share of a token's routes (plan_topk 1 of 8 at EP8): right
    values with most routes on other ranks, and a token's rows the same bits alone as in a launch of 16."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    x, w, ids, tw, ref = _moe_case(E=48, H=7168, I=2048, T=16, topk=8, seed=seed, share=1 / 8)
    full = fused_moe_frag(x, *w, ids, tw, G, plan_topk=1)
    _check(full, ref, TOL, "moe frag K2 slice, planned for one route a token")
    part = fused_moe_frag(x[:T], *w, ids[:T], tw[:T], G, plan_topk=1)
    assert torch.equal(part, full[:T]), f"T={T}: {int((part != full[:T]).sum())} elements differ from the T=16 launch"
    with pytest.raises(ValueError, match="plan_topk"):
        fused_moe_frag(x, *w, ids, tw, G, plan_topk=9)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_moe_frag_add_is_the_explicit_add(poisoned, T):
    """An addend (the shared expert's output, at a row stride of its own) added in the top-k sum: in the down
    GEMM's last programs (T = 1: 8 pairs, fused epilogues) or in the top-k sum launch, the bits of the routed
    output plus the addend as torch adds two bf16 tensors, at K2 widths."""
    x, w, ids, tw, _ = _moe_case(E=16, H=7168, I=2048, T=T, topk=8, unowned=T == 5)
    add = (torch.randn(T, 7168 + 8, device="cuda") * 3).to(torch.bfloat16)[:, 8:]
    for cfg in (None, FragMoEConfig(BLOCK_M=16), FragMoEConfig(BLOCK_M=32)):
        plain = fused_moe_frag(x, *w, ids, tw, G, cfg)
        fused = fused_moe_frag(x, *w, ids, tw, G, cfg, add=add)
        assert torch.equal(fused, plain + add), f"T={T} {cfg}: {int((fused != plain + add).sum())} elements differ"


@pytest.mark.parametrize("T", [1, 9, 64])
def test_moe_frag_tiled_words_same_bits(poisoned, T):
    """Expert words in frag_tile's order (each K block of 64 rows contiguous, per matrix) read through TILE:
    the same bits as row-major, with the table's configs and another partition; right at K2 shapes."""
    x, w, ids, tw, ref = _moe_case(E=16, H=7168, I=2048, T=T, topk=8, unowned=T == 9)
    q13, s13, q2, s2 = w
    tiled = (frag_tile(q13, frag_gpb(7168), 64), s13, frag_tile(q2, frag_gpb(2048), 64), s2)
    assert not torch.equal(tiled[0], q13)
    for cfg in (None, FragMoEConfig(BLOCK_M=16), FragMoEConfig(BLOCK_M=8, P13=40, P2=70), FragMoEConfig(BLOCK_M=32)):
        rows = fused_moe_frag(x, *w, ids, tw, G, cfg)
        _check(rows, ref, TOL, f"moe frag T={T} {cfg}")
        assert torch.equal(rows, fused_moe_frag(x, *tiled, ids, tw, G, cfg, tile=64)), f"T={T} {cfg}: other bits"


@pytest.mark.parametrize("case", ["k2-1", "k2-4", "k2-8", "small-16", "small-p13", "small-whole"])
def test_moe_frag_fused_epilogues_same_bits(poisoned, case, monkeypatch):
    """Small launches do the SwiGLU and the top-k sum in the GEMMs' last program of each tile (arrival counters)
    instead of their own launches: the same bits as those launches, call after call (the counters go back to 0),
    with pairs on other ranks' experts; K2 shapes on the engine's tiled words and odd partitions, the fusion
    allowed up to 64 pairs (the engine fuses one token's)."""
    from kdtree_engine.kernels import moe_frag

    kind, arg = case.split("-")
    if kind == "k2":
        T, cfgs, E, H, I = int(arg), [None], 32, 7168, 2048
    else:
        T, E, H, I = 5, 24, 512, 256
        cfgs = {"16": [FragMoEConfig(BLOCK_M=16)], "p13": [FragMoEConfig(BLOCK_M=8, P13=5, P2=7)],
                "whole": [FragMoEConfig(BLOCK_M=8, P13=4, P2=8)]}[arg]
    x, w, ids, tw, ref = _moe_case(E=E, H=H, I=I, T=T, topk=8, unowned=T != 1)
    q13, s13, q2, s2 = w
    tile = 64
    tiled = (frag_tile(q13, frag_gpb(H), tile), s13, frag_tile(q2, frag_gpb(I), tile), s2)
    monkeypatch.setattr(moe_frag, "FUSE_MAX_PAIRS", 64)   # fused beyond one token too: the same code
    for cfg in cfgs:
        assert moe_frag.fused_epilogues(T * 8, cfg or moe_frag.frag_moe_config(T * 8, E))
        fused = [fused_moe_frag(x, *tiled, ids, tw, G, cfg, tile=tile) for _ in range(3)]
        _check(fused[0], ref, TOL, f"moe frag fused {case}")
        with monkeypatch.context() as m:
            m.setattr(moe_frag, "FUSE_MAX_PAIRS", 0)
            plain = fused_moe_frag(x, *tiled, ids, tw, G, cfg, tile=tile)
        for r, y in enumerate(fused):
            assert torch.equal(y, plain), f"{case} {cfg} call {r}: the fused epilogues changed the bits"


@pytest.mark.parametrize("cfg", [None, FragMoEConfig(BLOCK_M=16), FragMoEConfig(BLOCK_M=32)])
def test_moe_frag_batch_invariant(cfg):
    """A token's output is the same, bit for bit, alone and in batches of 4 / 17 / 64 (T = 1 takes the
    few-pairs config), with every block size of the table (each pair is its own MMA column): at K2 widths, on
    the engine's partitions (gate/up 3 partials per tile) and a down stream partition (2)."""
    x, w, ids, tw, _ = _moe_case(E=32, H=7168, I=2048, T=64, topk=8)
    full = fused_moe_frag(x, *w, ids, tw, G, cfg)
    for bm in (8, 16, 32, 64):   # 32 / 64: wgmma programs
        other = fused_moe_frag(x, *w, ids, tw, G, FragMoEConfig(BLOCK_M=bm))
        assert torch.equal(full, other), f"block rows {bm} give other bits"
    stream2 = FragMoEConfig(P2=82)
    full2 = fused_moe_frag(x, *w, ids, tw, G, stream2)
    for bm in (8, 16, 32):
        assert torch.equal(full2, fused_moe_frag(x, *w, ids, tw, G, replace(stream2, BLOCK_M=bm))), f"P2 82 bm {bm}"
    for m in (1, 5):
        assert torch.equal(full2[:m], fused_moe_frag(x[:m], *w, ids[:m], tw[:m], G, stream2)), f"P2 82 T={m}"
    bad = []
    for m in (1, 4, 17):
        part = fused_moe_frag(x[:m], *w, ids[:m], tw[:m], G, cfg)
        if not torch.equal(part, full[:m]):
            bad.append((m, int((part != full[:m]).sum())))
    assert not bad, f"tokens differ from the T=64 launch (T, #elements): {bad}"


@pytest.mark.parametrize("M", [1, 9, 20, 33, 70, 130])
def test_frag_linear_plan_token_tiles(poisoned, M):
    """The engine's plan (dense_plan) with token tiles of 8 / 16 columns: right values, and the rows of
    every M equal the M = 130 launch bit for bit."""
    p, s = rand_w4(1024, 2048)
    q = frag_repack(p, frag_gpb(2048))
    x = torch.randn(130, 2048, device="cuda").to(torch.bfloat16)
    full = frag_linear(x, q, s)
    ref = (x.float() @ dequantize(p, s, G, torch.bfloat16).float().T).to(torch.bfloat16)
    _check(full, ref, TOL, "frag plan M=130")
    assert torch.equal(frag_linear(x[:M], q, s), full[:M])


def test_demo_runs_on_fragment_kernels_close_to_triton():
    """The embedded demo on CUDA in bfloat16: its experts take the fragment kernels (words reordered at
    load), and its logits agree with the Triton kernels' (checkpoint order) to bf16 rounding."""
    import importlib
    from pathlib import Path

    from kdtree_engine.engine import load_target
    from kdtree_engine.kernels.policy import KernelPolicy
    from kdtree_engine.model.int4_order import CHECKPOINT, FRAG, order_of
    from kdtree_engine.model.moe import MoE

    demo = Path(importlib.import_module("kdtree_engine").__file__).parent / "assets" / "demo"
    target = load_target(demo, device=torch.device("cuda"), dtype=torch.bfloat16, progress=False)
    experts = [layer.mlp.experts for layer in target.layers if isinstance(layer.mlp, MoE)]
    assert experts and all(order_of(ex) == FRAG for ex in experts)
    ids = torch.randint(3, target.cfg.vocab_size, (40,), device="cuda")
    frag = target(ids, target.new_cache(64)).logits
    triton_policy = KernelPolicy(int4="triton")
    for m in target.modules():   # the same modules under the Triton kernels: their words go back in place
        if hasattr(m, "policy"):
            m.policy = triton_policy
    triton_logits = target(ids, target.new_cache(64)).logits
    assert all(order_of(ex) == CHECKPOINT for ex in experts)
    assert rel(frag, triton_logits) < 2e-2


def test_dependent_launches_in_graphs_read_fresh_inputs():
    """The GEMMs start before the kernel writing their input has finished (programmatic dependent launch)
    and wait before reading it: captured after a kernel that writes x (and the routing), replayed with new
    values, the dense GEMM (with its split sum) and the MoE at T = 1 / 3 equal eager launches bit for bit."""
    p, s = rand_w4(4096, 7168)
    q = frag_repack(p, 8)
    x0, w, ids0, tw0, _ = _moe_case(E=64, H=7168, I=2048, T=3, topk=8)
    for T in (1, 3):
        src = torch.randn(T, 7168, device="cuda").to(torch.bfloat16)
        sids, stw = ids0[:T].clone(), tw0[:T].clone()
        xb = torch.empty_like(src)
        ib = torch.empty_like(sids)
        torch.mul(src, 1.0, out=xb)
        torch.add(sids, 0, out=ib)
        frag_linear(xb, q, s)
        fused_moe_frag(xb, *w, ib, stw, G)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(src, 1.0, out=xb)                # kernels writing the GEMMs' inputs
            torch.add(sids, 0, out=ib)
            dense = frag_linear(xb, q, s)
            moe = fused_moe_frag(xb, *w, ib, stw, G)
        for r in range(6):
            src.copy_(torch.randn(T, 7168, device="cuda").to(torch.bfloat16))
            sids.copy_(torch.rand(T, 64, device="cuda").topk(8, dim=1).indices)
            graph.replay()
            xe = src.clone()
            assert torch.equal(dense, frag_linear(xe, q, s)), f"T={T} replay {r}: dense differs from eager"
            assert torch.equal(moe, fused_moe_frag(xe, *w, sids.clone(), stw, G)), f"T={T} replay {r}: MoE differs"


@pytest.mark.parametrize("N,K,split", [(2048, 7168, 4), (192, 2048, 1), (128, 256, 1)])
def test_frag_linear_tiled_scales_same_bits(poisoned, N, K, split):
    """Scales in scale_tile's order (each block of 64 rows contiguous) read through STILE: the same bits as
    row-major scales, on mma.sync (8 / 16 tokens) and wgmma programs."""
    p, s = rand_w4(N, K)
    q = frag_tile(frag_repack(p, 8), 8, 64)
    st = scale_tile(s, 8, 64)
    assert torch.equal(st, s) == (K == 256), "one block per row: nothing moves; more: the tiles move them"
    for M in (1, 13, 37):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        for tok, mma in ((8, "sync"), (16, "sync"), (32, "wgmma")):
            launch = _launch(x, N, K, programs=(N // 64) * split, tok=tok, mma=mma, tile=64)
            rows = frag_linear(x, q, s, launch=launch)
            other = frag_linear(x, q, st, launch=replace(launch, stile=64))
            assert torch.equal(rows, other), f"tiled scales: other bits ({launch} M {M})"


@pytest.mark.parametrize("T", [1, 9, 64])
def test_moe_frag_tiled_scales_same_bits(poisoned, T):
    """Expert scales in scale_tile's order read through STILE: the same bits as row-major scales with the table's
    configs (fused epilogues at T = 1, mma.sync and wgmma blocks), at K2 shapes on the tiled words."""
    x, w, ids, tw, ref = _moe_case(E=16, H=7168, I=2048, T=T, topk=8, unowned=T == 9)
    q13, s13, q2, s2 = w
    q13, q2 = frag_tile(q13, frag_gpb(7168), 64), frag_tile(q2, frag_gpb(2048), 64)
    st13, st2 = scale_tile(s13, frag_gpb(7168), 64), scale_tile(s2, frag_gpb(2048), 64)
    for cfg in (None, FragMoEConfig(BLOCK_M=16), FragMoEConfig(BLOCK_M=32)):
        rows = fused_moe_frag(x, q13, s13, q2, s2, ids, tw, G, cfg, tile=64)
        _check(rows, ref, TOL, f"moe frag T={T} {cfg}")
        other = fused_moe_frag(x, q13, st13, q2, st2, ids, tw, G, cfg, tile=64, stile=64)
        assert torch.equal(rows, other), f"T={T} {cfg}: {int((rows != other).sum())} elements differ"
