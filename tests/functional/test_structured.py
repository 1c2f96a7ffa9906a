"""Unit tests of the channel-group tracer and physical channel removal (no processes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from lightning_bigtrain.functional.structured import (
    channel_groups,
    channel_importance,
    keep_indices,
    mask_channels_,
    remove_channels_,
    resize_to_state_dict_,
)
from lightning_bigtrain.models import CharGPT, FashionCNN


class _Concat(nn.Module):
    """Two branches concatenated along channels, normalized together, flattened into a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 6, 3, padding=1)
        self.b = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(10)
        self.c = nn.Conv2d(10, 8, 1)
        self.fc = nn.Linear(8 * 7 * 7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(torch.cat([self.a(x), torch.relu(self.b(x))], 1)))
        return self.fc(torch.flatten(nn.functional.max_pool2d(self.c(y), 4), 1))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sigmoid(self.a(x)))  # sigmoid(0) = 0.5: a zeroed unit would still feed `b`


def _resnet18() -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _randomize_bn(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)


@pytest.mark.parametrize(
    ("build", "shape", "min_ratio", "max_ratio"),
    [
        (lambda: FashionCNN(channels=(8, 16)), (3, 1, 28, 28), 0.25, 0.4),
        (
            lambda: nn.Sequential(
                nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)
            ),
            (3, 1, 28, 28),
            0.45,
            0.55,
        ),
        (_resnet18, (2, 1, 28, 28), 0.2, 0.3),
        (_Concat, (3, 1, 28, 28), 0.4, 0.6),
    ],
    ids=["cnn", "mlp", "resnet18", "concat"],
)
def test_removed_model_computes_what_the_masked_model_computes(build, shape, min_ratio, max_ratio):
    """Removing half of every prunable group's channels gives the outputs of zeroing them (eval mode, BatchNorm
    statistics randomized so that they matter); tolerance: float32 summation order."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        _randomize_bn(model)
    x = torch.randn(shape)
    groups = channel_groups(model, (x,))
    kept = {g.id: keep_indices(channel_importance(model, g), 0.5) for g in groups if g.prunable}
    assert kept
    masked = copy.deepcopy(model)
    mask_channels_(masked, groups, kept)
    before = sum(p.numel() for p in model.parameters())
    remove_channels_(model, groups, kept)
    ratio = sum(p.numel() for p in model.parameters()) / before
    assert min_ratio < ratio < max_ratio
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked(x), rtol=1e-4, atol=1e-5)


def test_residual_partners_share_one_group_and_outputs_are_blocked():
    groups = channel_groups(_resnet18().eval(), (torch.randn(1, 1, 28, 28),))
    stage1 = next(g for g in groups if any(s.module == "conv1" for s in g.slots))
    modules = {s.module for s in stage1.slots}
    assert {"conv1", "bn1", "layer1.0.conv2", "layer1.1.conv2", "layer1.0.conv1", "layer2.0.downsample.0"} <= modules
    fc = next(g for g in groups if any(s.module == "fc" and s.kind == "out" for s in g.slots))
    assert not fc.prunable and "model's output" in fc.blocked[0]


def test_untraceable_parts_are_left_alone_and_named():
    gpt = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=16).eval()
    groups = channel_groups(gpt, (torch.randint(0, 96, (2, 16)),))
    prunable = [g for g in groups if g.prunable]
    assert [{s.module for s in g.slots} for g in prunable] == [
        {"blocks.0.mlp.0", "blocks.0.mlp.2"},
        {"blocks.0.attn.qkv", "blocks.0.attn.proj"},  # the heads, declared by the attention module
    ]
    qkv = next(g for g in groups if any(s.module == "blocks.0.attn.qkv" for s in g.slots))
    assert "split" in qkv.blocked[0]
    gated = channel_groups(_Gated(), (torch.randn(2, 8),))
    assert not any(g.prunable for g in gated) and "sigmoid" in gated[0].blocked[0]


def test_optimizer_state_follows_the_removed_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    exp_avg = optimizer.state[model[0].weight]["exp_avg"].clone()
    groups = channel_groups(model, (torch.randn(2, 6),))
    kept = {g.id: torch.tensor([1, 4, 6]) for g in groups if g.prunable}
    remove_channels_(model, groups, kept, [optimizer])
    assert model[0].weight.shape == (3, 6) and model[2].weight.shape == (3, 3)
    assert model[0].out_features == 3 and model[2].in_features == 3
    torch.testing.assert_close(optimizer.state[model[0].weight]["exp_avg"], exp_avg[[1, 4, 6]])
    assert all(p in optimizer.state for p in model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()  # the optimizer runs on the new shapes


def test_a_fresh_model_takes_a_pruned_state_dict_after_resizing():
    cnn = FashionCNN(channels=(8, 16)).eval()
    groups = channel_groups(cnn, (torch.randn(2, 1, 28, 28),))
    remove_channels_(cnn, groups, {g.id: torch.arange(g.size // 2) for g in groups if g.prunable})
    fresh = FashionCNN(channels=(8, 16)).eval()
    with pytest.raises(RuntimeError, match="size mismatch"):
        fresh.load_state_dict(cnn.state_dict())
    assert "features.0.weight" in resize_to_state_dict_(fresh, cnn.state_dict())
    fresh.load_state_dict(cnn.state_dict())
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(fresh(x), cnn(x))


def test_keep_indices_keeps_the_most_important():
    assert keep_indices(torch.tensor([0.1, 5.0, 0.3, 2.0]), 0.5).tolist() == [1, 3]
    assert keep_indices(torch.tensor([1.0, 2.0]), 0.99).tolist() == [1]  # never empties a layer
    assert keep_indices(torch.rand(20), count=13, round_to=8).numel() == 8


def test_whole_attention_heads_are_removed():
    """Heads declared through ``head_slots``: removing two of four gives the outputs of zeroing their query, key
    and value rows (a zero head attends uniformly to zero values); ``n_head`` follows, also after resizing a
    fresh model to the pruned state dict."""
    torch.manual_seed(0)
    gpt = CharGPT(block_size=16, n_layer=2, n_head=4, n_embd=32).eval()
    x = torch.randint(0, 96, (2, 16))
    groups = channel_groups(gpt, (x,))
    heads = [g for g in groups if g.prunable and g.size == 4]
    assert len(heads) == 2 and all(s.block == 8 for g in heads for s in g.slots)
    kept = {g.id: torch.tensor([0, 3]) for g in heads}
    masked = copy.deepcopy(gpt)
    mask_channels_(masked, groups, kept)
    remove_channels_(gpt, groups, kept)
    assert [b.attn.n_head for b in gpt.blocks] == [2, 2]
    assert gpt.blocks[0].attn.qkv.weight.shape == (48, 32) and gpt.blocks[0].attn.proj.weight.shape == (32, 16)
    with torch.no_grad():
        torch.testing.assert_close(gpt(x), masked(x), rtol=1e-4, atol=1e-5)
    fresh = CharGPT(block_size=16, n_layer=2, n_head=4, n_embd=32).eval()
    resize_to_state_dict_(fresh, gpt.state_dict())
    fresh.load_state_dict(gpt.state_dict())
    assert [b.attn.n_head for b in fresh.blocks] == [2, 2]
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), gpt(x))


@pytest.mark.parametrize(
    ("family", "min_removed"),
    [("hf_gpt2", 0.4), ("hf_llama", 0.4), ("hf_t5", 0.15), ("hf_bert", 0.35), ("lightning_demo_transformer", 0.4),
     ("nn_transformer", 0.35)],
)  # fmt: skip
def test_transformers_lose_heads_and_widths_and_compute_what_the_masked_model_computes(family, min_removed):
    """Models this project did not write, as their users build them: Hugging Face's GPT-2 (Conv1D), Llama (SwiGLU,
    grouped-query attention) and T5 traced through the submodule the LightningModule calls, with keyword arguments;
    Lightning's demo Transformer and an nn.TransformerEncoder LM (nn.MultiheadAttention swapped for HeadedAttention,
    feed-forward widths from the layers' structure). Removing half of each prunable group's channels gives the
    outputs of zeroing them."""
    pytest.importorskip("transformers")
    from benchmarks.conformance import FAMILIES, _build
    from lightning_bigtrain.functional.attention import swap_multihead_attention_

    torch.manual_seed(0)
    model = _build(FAMILIES[family], 0).model.eval()
    swap_multihead_attention_(model)
    x = torch.randint(0, 96, (2, 16))
    args, kwargs = ((x, x), {}) if family == "lightning_demo_transformer" else ((x,), {})
    if family.startswith("hf_"):
        args, kwargs = (), {"input_ids": x, **({"decoder_input_ids": x} if family == "hf_t5" else {})}

    def run(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            out = m(*args, **kwargs)
        return out.logits if hasattr(out, "logits") else out

    groups = channel_groups(model, args, example_kwargs=kwargs)
    kept = {g.id: keep_indices(channel_importance(model, g), 0.5) for g in groups if g.prunable}
    masked = copy.deepcopy(model)
    mask_channels_(masked, groups, kept)
    before = sum(p.numel() for p in model.parameters())
    remove_channels_(model, groups, kept)
    assert 1 - sum(p.numel() for p in model.parameters()) / before > min_removed
    torch.testing.assert_close(run(model), run(masked), rtol=1e-4, atol=1e-5)


def test_ignore_names_must_be_modules_of_the_model():
    cnn = FashionCNN(channels=(8, 16)).eval()
    x = torch.randn(2, 1, 28, 28)
    with pytest.raises(ValueError, match=r"channel_groups\(ignore=.*\): FashionCNN has no module 'features\.04'.*"
                                         r"did you mean .*'features\.0'"):  # fmt: skip
        channel_groups(cnn, (x,), ignore=["features.04"])
    groups = channel_groups(cnn, (x,), ignore=["features.0"])
    assert any("features.0 is in `ignore`" in reason for g in groups for reason in g.blocked)
