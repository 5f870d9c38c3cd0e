"""The router-logit GEMM (kernels/router_gemm.py) on the GPU at the K2 router shape and odd shapes, on
fresh random inputs: close to the float64 product, every row bit-identical whatever rows share the
launch, bf16 activations equal to their exact float32 upcast."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("N,K", [(384, 7168), (20, 300), (64, 2048)])
def test_router_logits_close_and_batch_invariant(N, K):
    from kdtree_engine.kernels.router_gemm import router_logits
    x = torch.randn(130, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda") * K ** -0.5
    full = router_logits(x, w)
    ref = x.double() @ w.double().T
    assert float((full.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    bad = [m for m in (1, 2, 3, 4, 5, 9, 16, 17, 33, 64, 129) if not torch.equal(router_logits(x[:m], w), full[:m])]
    assert not bad, f"rows differ from the M=130 launch at M = {bad}"
    assert torch.equal(router_logits(x[7:50], w), full[7:50])
    assert torch.equal(router_logits(x.float(), w), full)


def test_router_module_takes_the_kernel_on_cuda():
    """The model's router on CUDA (batch invariance on) gives the kernel's logits, not the generic GEMM's."""
    from kdtree_engine.config import preset
    from kdtree_engine.kernels.router_gemm import router_logits
    from kdtree_engine.model.moe import Router
    cfg = preset("k2-tiny")
    r = Router(cfg).cuda()
    r.weight.data = torch.randn_like(r.weight) * 0.1
    x = torch.randn(5, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    from kdtree_engine.kernels import dispatch
    assert torch.equal(dispatch.router_matmul(x, r.weight), router_logits(x, r.weight))
