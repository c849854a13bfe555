"""The compiled loss of `poslens train` on CUDA (runs only where a GPU is present): `compiled_cross_entropy`
(the fused kernel a compiled model's training step uses) agrees with the eager float32 cross-entropy, value and
gradient, on bf16 logits of a real vocabulary's width. Tolerance 1e-5 relative: both reduce in float32 over the
same inputs, only the order of the additions differs (float32 epsilon 1.2e-7 times sums of ~5e4 terms)."""

import pytest
import torch

from poslens.train.loop import compiled_cross_entropy, cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_compiled_cross_entropy_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(4, 256, 49152, device="cuda", generator=g)).bfloat16()
    targets = torch.randint(0, 49152, (4, 256), device="cuda", generator=g)
    grads = []
    for fn in (cross_entropy, compiled_cross_entropy()):
        x = logits.clone().requires_grad_(True)
        loss = fn(x, targets)
        loss.backward()
        grads.append((loss.detach(), x.grad.float()))
    (a, ga), (b, gb) = grads
    assert torch.allclose(a, b, rtol=1e-5, atol=0)
    assert torch.allclose(ga, gb, rtol=1e-2, atol=1e-9)  # bf16 gradients: 8 bits of mantissa


def test_optimizer_fused_on_cuda_same_update():
    """`make_optimizer` takes torch's fused AdamW when every parameter is on CUDA (one kernel per step); its update
    equals the multi-tensor AdamW's (the CPU path) to 1e-6 relative after three steps on the same gradients: both
    compute the same float32 formula, only the kernels' operation order differs."""
    from poslens.train.config import resolve_config
    from poslens.train.loop import make_optimizer
    from poslens.train.model import build_model

    cfg = resolve_config("tiny", hidden=64, intermediate=128, layers=2)
    models = [build_model(cfg, 256).cuda() for _ in range(2)]
    fused = make_optimizer(models[0], cfg)
    assert fused.defaults["fused"] is True
    groups = [{"params": [p for p in models[1].parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in models[1].parameters() if p.dim() < 2], "weight_decay": 0.0}]
    plain = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            grad = torch.randn(a.shape, device="cuda", generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
