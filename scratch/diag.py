import time, random, sys, collections
import torch, triton
from kdtree_engine import LLM, SamplingParams
compiled = []
def hook(**kw):
    compiled.append(kw.get("repr") or str(kw.get("key")))
    return None
triton.knobs.runtime.jit_post_compile_hook = hook
t0 = time.time()
llm = LLM(device="cuda", progress=False)
print("load", time.time() - t0, flush=True)
print("compiled at load", len(compiled))
rng = random.Random(0)
V = llm.target.cfg.vocab_size
prev = set()
lens = [100, 100, 101, 117, 128, 129, 130, 200, 255, 256, 300, 333, 512, 17, 16, 1, 2, 3, 4, 63, 64, 65, 400, 401, 402, 403]
for L in lens:
    n0 = len(compiled)
    ids = [rng.randrange(1, V) for _ in range(L)]
    t = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    wall = time.perf_counter() - t
    new = compiled[n0:]
    print(f"L={L} prefill_s={out.stats['prefill_s']*1e3:.2f}ms wall={wall*1e3:.1f}ms new_compiles={len(new)}", flush=True)
    for r in new:
        print("   ", r[:600])
# plain decoding too
for L in [100, 150, 151]:
    n0 = len(compiled)
    ids = [rng.randrange(1, V) for _ in range(L)]
    out = llm.run(ids, SamplingParams(max_tokens=1), plain=True)
    print(f"plain L={L} prefill_s={out.stats['prefill_s']*1e3:.2f}ms new={len(compiled)-n0}")
    for r in compiled[n0:]:
        print("   ", r[:600])
