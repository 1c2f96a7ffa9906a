"""Module surgery: each swap is equivalent (outputs and gradients, stated tolerances), keeps the module's
parameters, state_dict keys and methods, follows structural changes, and refuses what it cannot handle."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bigtrain.functional.surgery import (
    fold_conv_bn,
    recomputed_norm_activation,
    refresh_swaps,
    restore_modules,
    sdpa_fallbacks,
    swap_modules,
)
from lightning_bigtrain.models import FashionCNN


class HandAttention(nn.Module):
    """Causal self-attention as GPT-2 reimplementations write it: a lower-triangular buffer, an explicit
    softmax and a dropout on the weights."""

    def __init__(self, d: int = 32, n_head: int = 4, block: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head, self.d = n_head, d
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)

    def heads(self) -> int:
        return self.n_head


class PaddedAttention(nn.Module):
    """Single head, scale by division, a boolean padding mask from the caller, ``Tensor.softmax``."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        return scores.softmax(dim=-1) @ self.v(x)


class BiasedAttention(nn.Module):
    """An additive float mask (ALiBi-like bias), no scale."""

    def __init__(self, d: int = 24, length: int = 10) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("slopes", -0.1 * (torch.arange(length)[None, :] - torch.arange(length)[:, None]).abs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) + self.slopes, dim=-1) @ v


class WeightsReturned(HandAttention):
    """Returns the attention weights too: they must stay materialized, so no swap."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        att = F.softmax((q @ k.transpose(-2, -1)) * 0.1, dim=-1)
        return att @ v, att


class Wrapper(nn.Module):
    """Untraceable (control flow on a value) around a traceable attention: the child is still swapped."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = HandAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e9:
            return x
        return self.attn(x)


def _grads(module: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad()
    out = module(*inputs)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


def _assert_equivalent(swapped: nn.Module, reference: nn.Module, *inputs: torch.Tensor, atol: float) -> None:
    out, grads = _grads(swapped, *inputs)
    ref_out, ref_grads = _grads(reference, *inputs)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=atol * max(1.0, float(r.abs().max())), rtol=1e-4)


@pytest.mark.parametrize(
    ("module", "inputs"),
    [
        (HandAttention(), (torch.randn(3, 12, 32),)),
        (PaddedAttention(), (torch.randn(2, 10, 24), torch.arange(10)[None, :] < torch.tensor([[10], [6]]))),
        (BiasedAttention(), (torch.randn(2, 10, 24),)),
    ],
    ids=["causal_buffer", "padding_mask", "additive_bias"],
)
def test_hand_written_attention_becomes_sdpa_with_the_same_outputs_and_gradients(module, inputs):
    """Tolerance: 1e-5 absolute on outputs, 1e-5 of the largest gradient entry on gradients (fp32; SDPA sums
    in a different order)."""
    torch.manual_seed(0)
    reference = copy.deepcopy(module)
    swaps = swap_modules(module)
    assert [s.kind for s in swaps] == ["attention"]
    _assert_equivalent(module, reference, *inputs, atol=1e-5)
    assert module.state_dict().keys() == reference.state_dict().keys()
    code = module.__dict__["_bigtrain_surgery"].fn.__code__.co_names
    assert "softmax" not in code and "masked_fill" not in code


def test_causal_buffer_becomes_is_causal_and_dropout_follows_the_module():
    attention = HandAttention(dropout=0.5)
    (swap,) = swap_modules(attention)
    assert "is_causal=True" in swap.detail and "dropout=attn_dropout" in swap.detail
    reference = copy.deepcopy(attention)
    restore_modules(reference)
    x = torch.randn(2, 8, 32)
    attention.eval(), reference.eval()
    torch.testing.assert_close(attention(x), reference(x), atol=1e-5, rtol=1e-5)  # no dropout in eval
    attention.train()
    torch.manual_seed(0)
    a, b = attention(x), attention(x)
    assert not torch.equal(a, b)  # dropout active in training
    attention.attn_dropout.p = 0.0
    torch.testing.assert_close(attention(x), reference(x), atol=1e-5, rtol=1e-5)  # p=0: no dropout drawn


def test_attention_with_dropout_on_cpu_is_reported_as_keeping_its_written_math():
    """On CPU, SDPA has no fused kernel with dropout, so in training the swapped forward computes the weights as
    written: such swaps are named by ``sdpa_fallbacks`` (and reported so by OperatorFusion), not passed off as
    SDPA. Without dropout, or with p = 0, SDPA runs."""
    attention = HandAttention(dropout=0.1)
    swaps = swap_modules(attention)
    assert sdpa_fallbacks(attention, swaps) == swaps
    attention.attn_dropout.p = 0.0
    assert sdpa_fallbacks(attention, swaps) == []
    plain = HandAttention()
    assert sdpa_fallbacks(plain, swap_modules(plain)) == []


def test_swapped_modules_keep_their_methods_copy_and_restore():
    attention = HandAttention()
    swap_modules(attention)
    assert attention.heads() == 4 and type(attention) is HandAttention
    clone = copy.deepcopy(attention)
    assert clone.forward.__self__ is clone  # the copy's forward drives the copy's weights
    with torch.no_grad():
        clone.c_proj.weight.zero_(), clone.c_proj.bias.zero_()
    assert torch.count_nonzero(clone(torch.randn(1, 4, 32))) == 0
    assert restore_modules(attention) == 1
    assert attention.forward.__func__ is HandAttention.forward


def test_a_structure_change_retraces_the_swapped_forward():
    """Pruning heads changes ``n_head``, which the traced forward baked in: the next call re-traces."""
    torch.manual_seed(0)
    attention = HandAttention(d=32, n_head=4)
    reference = copy.deepcopy(attention)
    swap_modules(attention)
    attention.n_head = reference.n_head = 2
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(attention(x), reference(x), atol=1e-5, rtol=1e-5)
    attention.n_head = reference.n_head = 8
    assert refresh_swaps(attention)  # the explicit refresh (used under torch.compile) re-traces too
    torch.testing.assert_close(attention(x), reference(x), atol=1e-5, rtol=1e-5)


def test_what_cannot_be_swapped_is_left_as_written():
    returned = WeightsReturned()
    assert swap_modules(returned) == []
    assert "forward" not in returned.__dict__
    wrapper = Wrapper()  # the wrapper cannot be traced, its child can
    assert [s.path for s in swap_modules(wrapper)] == ["attn"]
    with pytest.raises(ValueError, match=r"unknown.*'fusion'"):
        swap_modules(wrapper, ["fusion"])


class NormChains(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.gn = nn.GroupNorm(4, d)
        self.act = nn.SiLU()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.ln(x), approximate="tanh")
        y = self.act(self.gn(y))
        return torch.relu(self.bn(y)) + y


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def test_norm_activation_pairs_are_recomputed_bit_equal_and_store_less():
    """LayerNorm -> gelu(tanh) and GroupNorm -> SiLU become recomputed units: bit-equal outputs and gradients
    (the same kernels run again), and the activations' saved tensors are gone. BatchNorm -> relu is not
    swapped in training (recomputing would update its running statistics twice)."""
    torch.manual_seed(0)
    module = NormChains()
    reference = copy.deepcopy(module)
    swaps = swap_modules(module, ["norm_activation"])
    assert sorted(s.detail.split(":")[0] for s in swaps) == ["gn -> act", "ln -> gelu"]
    x = torch.randn(64, 16, requires_grad=True)
    out, grads = _grads(module, x)
    ref_out, ref_grads = _grads(reference, x)
    assert torch.equal(out, ref_out) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert _saved_bytes(module, x) <= _saved_bytes(reference, x) - 2 * x.numel() * 4
    assert torch.equal(module.bn.running_mean, reference.bn.running_mean)


def test_recomputed_unit_without_grad_runs_plainly():
    norm = nn.LayerNorm(8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(recomputed_norm_activation(x, norm, "gelu", (), {}), F.gelu(norm(x)))


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.skip_bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x))).sum(1, keepdim=True) + self.skip_bn(x)


def _trained_statistics(module: nn.Module, x: torch.Tensor) -> None:
    module.train()
    with torch.no_grad():
        for _ in range(3):
            module(x)


def test_conv_bn_folding_keeps_evaluation_outputs():
    """Tolerance: 1e-5 absolute (the folded weights round once more)."""
    torch.manual_seed(0)
    cnn = FashionCNN(channels=(8, 16))
    _trained_statistics(cnn, torch.randn(32, 1, 28, 28))
    folded = fold_conv_bn(cnn)
    assert cnn.training is True and isinstance(cnn.features[1], nn.BatchNorm2d)  # the original is untouched
    assert not folded.training and not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), cnn.eval()(x), atol=1e-5, rtol=1e-5)

    block = ConvBlock()  # a pair found through the graph; the BatchNorm on the input has no conv before it
    _trained_statistics(block, torch.randn(8, 3, 6, 6))
    reference = copy.deepcopy(block).eval()
    fold_conv_bn(block, inplace=True)
    assert isinstance(block.bn, nn.Identity) and isinstance(block.skip_bn, nn.BatchNorm2d)
    with torch.no_grad():
        x = torch.randn(4, 3, 6, 6)
        torch.testing.assert_close(block(x), reference(x), atol=1e-5, rtol=1e-5)


def test_conv_bn_folding_refuses_batch_statistics():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(ValueError, match="track_running_stats=False"):
        fold_conv_bn(model)
