"""Times each case of the DDTree builder GPU test apart (top-k log-probs, then the one-program builder), printing
as it goes, so a slow or stuck case shows in the log: python3 scripts/diag_tree_gpu.py"""

import time

import torch

from kdtree_engine.kernels.tree_ops import build_tree_triton
from kdtree_engine.speculative.tree import topk_logprobs

g = torch.Generator().manual_seed(0)
for L, V, budget in ((15, 1000, 16), (15, 1000, 64), (7, 3, 200), (15, 32000, 256), (5, 20, 40), (6, 30, 24),
                     (15, 163840, 64), (15, 1000, 256)):
    logits = (torch.randn(L, V, generator=g) * 3).cuda()
    t0 = time.time()
    lp, ids = topk_logprobs(logits, budget)
    torch.cuda.synchronize()
    t1 = time.time()
    build_tree_triton(lp, ids, budget, torch.tensor(5, device="cuda"), torch.tensor(100, device="cuda"))
    torch.cuda.synchronize()
    print(f"L={L} V={V} budget={budget}: top-k {t1 - t0:.1f} s, tree {time.time() - t1:.1f} s", flush=True)
