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
