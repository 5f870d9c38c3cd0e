"""One kernel case at K2 shapes, launched once inside a profiler range: the target of Nsight Compute.

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \
        python3 bench/ncu_probe.py mla_decode_32k

The case is run once before the range (compiles, warms the caches of the allocator), then once inside
cudaProfilerStart/Stop, so `--profile-from-start off` profiles exactly the launches of one call. After
the range it prints each Triton kernel's registers, spills and shared memory per compiled variant.
Cases: mla_decode_{4k,32k,128k} (N=8, T=1), mla_verify16_32k (N=8, T=16, random tree), mla_tree4_4k (N=8, 4 nodes),
mla_tree{2,4}_4k_n64 / mla_decode_4k_n64 (N=64: 2 / 4 nodes, one query), moe_t{1,16}
(384 experts top-8; moe_frag_t{1,4,16,64}: the fragment kernels on the engine's word order), dense_m1 (36864 x 7168 W4A16, M=1; dense_frag_m{4,16}: the engine's fragment kernel), plane_m1 (the same by the nibble-plane kernel).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernels import E, G, H, I, TOPK, rand_w4, route  # noqa: E402
from bench.mla_attention import C, R, SCALE, make_case  # noqa: E402
from kdtree_engine.kernels import mla_attention as mla_mod  # noqa: E402
from kdtree_engine.kernels import moe_w4a16, w4a16  # noqa: E402


def _mla(S: int, T: int, N: int = 8):
    q_lat, q_pe, kvs, mask = make_case(N, S, T, 1)
    return lambda: mla_mod.mla_attention(q_lat, q_pe, kvs[0], S, mask, SCALE, C)


def _moe(T: int):
    w13p, w13s = rand_w4(E, 2 * I, H, g=G)
    w2p, w2s = rand_w4(E, H, I, g=G)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, tw = route(T, 1, torch.Generator(device="cuda").manual_seed(0))[0]
    return lambda: moe_w4a16.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G)


def _moe_frag(T: int, cfg=None):
    from kdtree_engine.kernels.moe_frag import fused_moe_frag
    from kdtree_engine.kernels.layouts import ENGINE_ORDER, to_engine_int4
    w13p, w13s = to_engine_int4(*rand_w4(E, 2 * I, H, g=G), H)   # as the engine keeps them
    w2p, w2s = to_engine_int4(*rand_w4(E, H, I, g=G), I)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, tw = route(T, 1, torch.Generator(device="cuda").manual_seed(0))[0]
    return lambda: fused_moe_frag(x, w13p, w13s, w2p, w2s, ids, tw, G, cfg, **ENGINE_ORDER)


def _dense(M: int):
    p, s = rand_w4(36864, 7168, g=G)
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    return lambda: w4a16.w4a16_linear(x, p, s, G)


def _dense_frag(M: int):
    from kdtree_engine.kernels.layouts import ENGINE_ORDER, to_engine_int4
    from kdtree_engine.kernels.w4_frag import frag_linear
    p, s = to_engine_int4(*rand_w4(36864, 7168, g=G), 7168)
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    return lambda: frag_linear(x, p, s, **ENGINE_ORDER)


def _plane(M: int, cand=(64, 64, 4, 2, False, True, 1)):
    from bench.w4_plane_probe import run_plane
    p, s = rand_w4(36864, 7168, g=G)
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    return lambda: run_plane(x, p, s, cand, 1, 7168 // 8)


CASES = {
    "mla_decode_4k": lambda: _mla(4096, 1),
    "mla_decode_32k": lambda: _mla(32768, 1),
    "mla_decode_128k": lambda: _mla(131072, 1),
    "mla_verify16_32k": lambda: _mla(32768, 16),
    "mla_tree4_4k": lambda: _mla(4096, 4),
    "mla_tree4_4k_n64": lambda: _mla(4096, 4, 64),
    "mla_tree2_4k_n64": lambda: _mla(4096, 2, 64),
    "mla_decode_4k_n64": lambda: _mla(4096, 1, 64),
    "mla_tree64_4k_n64": lambda: _mla(4096, 64, 64),
    "moe_t1": lambda: _moe(1),
    "moe_t16": lambda: _moe(16),
    "moe_frag_t1": lambda: _moe_frag(1),
    "moe_frag_t4": lambda: _moe_frag(4),
    "moe_frag_t16": lambda: _moe_frag(16),
    "moe_frag_t64": lambda: _moe_frag(64),
    "dense_m1": lambda: _dense(1),
    "dense_frag_m4": lambda: _dense_frag(4),
    "dense_frag_m16": lambda: _dense_frag(16),
    "plane_m1": lambda: _plane(1),
    "plane_wb_m1": lambda: _plane(1, (64, 64, 4, 2, True, True, 8)),
}


def kernel_report() -> list[str]:
    lines = []
    for mod in (mla_mod, moe_w4a16, w4a16):
        for name in dir(mod):
            fn = getattr(mod, name)
            cache = getattr(fn, "device_caches", None) or getattr(fn, "cache", None)
            if not name.endswith("_kernel") or cache is None:
                continue
            for dev_cache in (cache.values() if isinstance(cache, dict) else []):
                kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
                for k in getattr(kernels, "values", lambda: [])():
                    lines.append(f"{name}: regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                                 f"smem {k.metadata.shared} warps {k.metadata.num_warps} "
                                 f"stages {k.metadata.num_stages}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: ncu_probe.py CASE; CASE one of {', '.join(CASES)}", file=sys.stderr)
        return 2
    fn = CASES[argv[0]]()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("\n".join(kernel_report()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
