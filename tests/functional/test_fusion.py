"""Fusion helpers: the fused optimizer takes the same steps with the same state; repeated blocks are found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.fusion import fuse_optimizer, repeated_blocks, supports_fused
from lightning_bigtrain.models import CharGPT, FashionCNN


def test_fused_optimizer_continues_the_same_trajectory_with_its_state():
    torch.manual_seed(0)
    a, b = nn.Linear(20, 30), nn.Linear(20, 30)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(8, 20)
    for step in range(6):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        if step == 2:  # mid-run: moments and step counts carried over
            opt_b = fuse_optimizer(opt_b)
            assert opt_b.param_groups[0]["fused"] and opt_b.param_groups[0]["weight_decay"] == 0.1
            assert int(opt_b.state[b.weight]["step"]) == 3
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)  # the kernels round differently, not more


def test_what_cannot_be_fused_says_why():
    model = nn.Linear(2, 2)
    assert "has no fused implementation" in supports_fused(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match=r"fuse_optimizer\(LBFGS\): LBFGS has no fused implementation"):
        fuse_optimizer(torch.optim.LBFGS(model.parameters()))
    assert supports_fused(torch.optim.SGD(model.parameters(), lr=0.1)) is None


def test_repeated_blocks_are_the_outermost_repeated_modules():
    gpt = CharGPT(n_layer=3, n_embd=32, n_head=2, block_size=16)
    assert [type(m).__name__ for m in repeated_blocks(gpt)] == ["Block"] * 3
    assert repeated_blocks(FashionCNN()) == []  # no repeated composite module: regional falls back to full
    # nn.Transformer holds its layers in two ModuleLists (never called themselves): the layers are the blocks.
    t = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16)
    names = [type(m).__name__ for m in repeated_blocks(t)]
    assert names == ["TransformerEncoderLayer"] * 2 + ["TransformerDecoderLayer"] * 2
