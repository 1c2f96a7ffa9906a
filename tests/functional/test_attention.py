"""HeadedAttention computes what nn.MultiheadAttention computes, for every mask and layout it accepts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.attention import HeadedAttention, swap_multihead_attention_

_CAUSAL = torch.ones(5, 5).triu(1).bool()
_PAD = torch.zeros(3, 5, dtype=torch.bool)
_PAD[0, -2:] = True


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"need_weights": False},
        {},
        {"average_attn_weights": False},
        {"attn_mask": _CAUSAL, "need_weights": False},
        {"attn_mask": torch.zeros(5, 5).masked_fill(_CAUSAL, -1e9)},
        {"key_padding_mask": _PAD, "need_weights": False},
        {"key_padding_mask": _PAD, "attn_mask": _CAUSAL},
    ],
    ids=["no-weights", "weights", "per-head-weights", "bool-mask", "float-mask", "padding", "padding+mask"],
)
def test_same_outputs_and_weights_as_nn_multihead_attention(batch_first, kwargs):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    headed = HeadedAttention.from_torch(mha)
    assert not headed.training
    x = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    (a, wa), (b, wb) = mha(x, x, x, **kwargs), headed(x, x, x, **kwargs)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if wa is None:
        assert wb is None
    else:
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)


def test_swapped_transformer_layers_compute_the_same_and_skip_the_packed_fast_path():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
    x, mask = torch.randn(2, 5, 16), nn.Transformer.generate_square_subsequent_mask(5)
    reference = encoder(x, mask=mask, is_causal=True)
    assert swap_multihead_attention_(encoder) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert not encoder.use_nested_tensor
    torch.testing.assert_close(encoder(x, mask=mask, is_causal=True), reference, rtol=1e-5, atol=1e-6)
    encoder.eval()  # the inference path reads the packed projection of nn.MultiheadAttention: it must not be taken
    encoder(x)


def test_modules_it_cannot_represent_are_left_alone():
    mha = nn.MultiheadAttention(16, 4, add_bias_kv=True)
    holder = nn.ModuleDict({"a": mha})
    assert swap_multihead_attention_(holder) == [] and holder["a"] is mha


def test_swapped_on_the_meta_device_the_projections_hold_the_packed_weights_values():
    """Tensor parallelism swaps a meta model's attention before it is materialized: the new projections' values are
    recorded as slices of the packed ``in_proj_weight`` (Xavier over the packed shape, zero biases), not their
    Linear default (Kaiming, drawn biases); built there before, the copy out of meta failed."""
    from lightning_bigtrain.functional.materialize import init_records, materialize_, record_init

    with record_init(), torch.device("meta"):
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    swap_multihead_attention_(layer)
    assert isinstance(layer.self_attn, HeadedAttention) and layer.self_attn.q_proj.weight.is_meta
    records = init_records(layer)
    assert materialize_(layer, torch.device("cpu"), records) == ([], [], [])
    attention = layer.self_attn
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj):
        assert torch.equal(proj.bias, torch.zeros(32))
    weights = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    bound = (6 / (96 + 32)) ** 0.5  # Xavier's over the packed (96, 32) weight; the Linear default's: 1/sqrt(32)
    assert 1 / 32**0.5 < weights.abs().max() <= bound
