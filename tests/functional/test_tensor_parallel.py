"""The automatic tensor-parallel plan (structure only), the packed layout's arithmetic, the verification's refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.tensor_parallel import (
    Split,
    _pack_rows_,
    _unpacked_segments,
    plan_tensor_parallel,
    unpack_rows,
)
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import ZeroStrategy
from tests.helpers.distributed import run_on_ranks


def test_chargpt_plan_splits_attention_by_heads_mlp_in_pairs_and_the_vocabulary():
    plan = plan_tensor_parallel(CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32), 2)
    assert plan.blocks == ["blocks.0", "blocks.1"]
    assert plan.splits["blocks.0.attn.qkv"] == Split("column", pack=3)
    assert plan.splits["blocks.0.attn.proj"] == Split("row")
    assert plan.splits["blocks.1.mlp.0"] == Split("column") and plan.splits["blocks.1.mlp.2"] == Split("row")
    assert plan.splits["tok_emb"] == Split("vocab_embedding") and plan.splits["lm_head"] == Split("vocab_head")
    assert "pos_emb" not in plan.splits  # a position table is not the vocabulary, even when it is the larger one
    assert plan.attributes["blocks.0.attn"] == {"n_head": 4}
    assert plan.packed() == {"blocks.0.attn.qkv.weight": (3, 0), "blocks.0.attn.qkv.bias": (3, 0),
                             "blocks.1.attn.qkv.weight": (3, 0), "blocks.1.attn.qkv.bias": (3, 0)}  # fmt: skip


def test_plan_leaves_blocks_whole_when_heads_do_not_divide():
    plan = plan_tensor_parallel(CharGPT(n_layer=2, n_head=3, n_embd=48, block_size=32), 2)
    assert "blocks.0.attn.qkv" not in plan.splits
    assert plan.splits["blocks.0.mlp.0"] == Split("column")  # the MLP still splits


def test_hugging_face_conv1d_is_planned_along_its_own_dimensions():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    plan = plan_tensor_parallel(transformers.GPT2LMHeadModel(cfg), 2)
    assert plan.splits["transformer.h.0.attn.c_attn"] == Split("column", pack=3, conv1d=True)
    assert plan.splits["transformer.h.0.mlp.c_proj"] == Split("row", conv1d=True)
    assert plan.packed()["transformer.h.0.attn.c_attn.weight"] == (3, 1)
    assert plan.attributes["transformer.h.0.attn"] == {"num_heads": 4, "split_size": 64}
    assert plan.splits["transformer.wte"] == Split("vocab_embedding")  # tied to lm_head: split together


@pytest.mark.parametrize("dim", [0, 1])
def test_packed_reorder_and_its_inverse(dim):
    torch.manual_seed(0)
    linear = nn.Linear(8, 24) if dim == 0 else nn.Linear(24, 8)
    if dim == 1:  # stand-in for a Conv1D: outputs along dimension 1
        linear.weight, linear.bias = nn.Parameter(torch.randn(8, 24)), nn.Parameter(torch.randn(24))
        linear.__class__ = type("Conv1D", (nn.Linear,), {})
    before, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    _pack_rows_(linear, pack=3, degree=2)
    q, k, v = before.movedim(dim, 0).split(8)
    # Rank 0's contiguous half holds its heads of q, k and v, then rank 1's.
    expected = torch.cat([q[:4], k[:4], v[:4], q[4:], k[4:], v[4:]]).movedim(0, dim)
    torch.testing.assert_close(linear.weight.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(unpack_rows(linear.weight.detach(), 3, 2, dim), before, rtol=0, atol=0)
    torch.testing.assert_close(unpack_rows(linear.bias.detach(), 3, 2), bias, rtol=0, atol=0)


def test_unpacked_segments_map_split_rows_to_their_own_order():
    # width 8 per projection, 2 ranks: rank 1's rows [12, 24) are q[4:8], k[4:8], v[4:8].
    assert _unpacked_segments(12, 12, 8, 3, 2) == [(0, 4, 4), (4, 12, 4), (8, 20, 4)]
    # A piece that starts inside a run (FSDP2's shard of a split tensor).
    assert _unpacked_segments(14, 4, 8, 3, 2) == [(0, 6, 2), (2, 12, 2)]


def test_bad_tensor_parallel_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"tensor_parallel=0.*integer >= 1"):
        ZeroStrategy(stage=3, tensor_parallel=0)
    with pytest.raises(ValueError, match="offload"):
        ZeroStrategy(stage=2, tensor_parallel=2, offload_optimizer=True)
    with pytest.raises(ValueError, match="compression"):
        ZeroStrategy(stage=3, tensor_parallel=2, compression="fp16")
    with pytest.raises(ValueError, match="plan for degree"):
        from lightning_bigtrain.functional.tensor_parallel import TensorParallelPlan, apply_tensor_parallel_

        class Mesh:
            def size(self) -> int:
                return 2

        apply_tensor_parallel_(nn.Linear(2, 2), Mesh(), TensorParallelPlan(4))


class SoftmaxMLP(nn.Module):
    """Linear -> softmax over the hidden width -> Linear: shaped like a column/row pair, but the softmax needs the
    whole hidden vector, so splitting it would change the function (and nothing in the structure shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).softmax(-1))


def _verify(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_bigtrain.functional.tensor_parallel import apply_tensor_parallel_

    torch.manual_seed(0)
    model = nn.Sequential(SoftmaxMLP(), SoftmaxMLP())
    x = torch.randn(2, 5, 16)
    expected = model(x)
    plan = apply_tensor_parallel_(model, init_device_mesh("cpu", (2,)))
    return {"replicated": plan.replicated, "splits": plan.splits, "same": torch.equal(model(x), expected)}


def test_a_block_whose_split_changes_its_output_stays_whole_with_the_reason():
    for r in run_on_ranks(_verify):
        assert r["splits"] == {} and r["same"]
        assert set(r["replicated"]) == {"0", "1"}
        assert "differs from the original" in r["replicated"]["0"]
