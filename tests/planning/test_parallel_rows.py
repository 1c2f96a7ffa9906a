"""The planner's tensor-parallel rows (zero3_tp{T}); measured against runs in benchmarks/parallel.py."""

from __future__ import annotations

import torch

from lightning_bigtrain.models import CharGPT, FashionCNN
from lightning_bigtrain.planning import plan
from lightning_bigtrain.planning.parallel import estimate_tensor_parallel, layouts


def test_layouts_are_the_divisors_of_the_devices_per_node():
    assert layouts(1) == [] and layouts(4) == [2, 4] and layouts(6) == [2, 3, 6]


def test_tensor_parallel_rows_hold_the_split_states_and_the_measured_messages():
    model = CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32)
    rows = plan(model, devices=4, batch_shape=(4, 32), accelerator="cpu", compression=False)
    tp2, tp4 = rows["zero3_tp2"], rows["zero3_tp4"]
    # One group of 4 splits the blocks four ways and shards nothing more; two groups of 2 split them in two and
    # shard across the groups: both hold about a quarter of the model, the whole-kept norms and positions aside.
    psi = sum(p.numel() for p in model.parameters())
    for row in (tp2, tp4):
        assert psi * 16 / 4 <= row.model_states_bytes < psi * 16 / 4 * 1.1
    est = estimate_tensor_parallel(model, 2, 4, torch.zeros(4, 32, dtype=torch.long))
    # Per block: the attention's and the MLP's row outputs in forward, their column inputs in backward (4 all-reduces
    # of 4 x 32 x 64); the embedding's output; the head's logits gathered and its input's gradient all-reduced.
    assert sorted(est.messages) == sorted([("all_reduce", 4 * 32 * 64)] * 10 + [("all_gather", 4 * 32 * 96)])
    assert tp2.comm_bytes_per_step > est.tensor_parallel_bytes(4)  # plus ZeRO-3 across the two groups


def test_a_model_without_blocks_gets_no_tensor_parallel_row_and_a_note():
    rows = plan(FashionCNN(), devices=2, accelerator="cpu", compression=False)
    assert "zero3_tp2" not in rows.rows
    assert any("zero3_tp2" in note and "nothing" in note for note in rows.notes)


def test_a_recommended_tensor_parallel_row_gives_a_trainer_config_fit_reads():
    from lightning_bigtrain.planning.planner import strategy_config

    assert strategy_config("zero3") == "bigtrain_zero3"
    assert strategy_config("zero3_tp8") == {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
                                            "init_args": {"stage": 3, "tensor_parallel": 8}}  # fmt: skip
    # 8 devices per node, 2 nodes on a slow link: the split groups keep most bytes inside the nodes.
    big = CharGPT(vocab_size=96, block_size=256, n_layer=4, n_head=16, n_embd=512)
    rows = plan(big, devices=8, num_nodes=2, inter_node_bandwidth="25Gbps", batch_shape=(2, 256), compression=False)
    config = rows.trainer_config()
    assert config["strategy"] == strategy_config(str(rows.recommendation))


def test_tensor_parallel_activations_split_the_regions_between_column_and_row_splits():
    model = CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32)
    rows = plan(model, devices=2, batch_shape=(4, 32), accelerator="cpu", compression=False)
    whole, split = rows["zero3"].activation_bytes, rows["zero3_tp2"].activation_bytes
    # Attention's heads and the MLP's hidden activation halve; block inputs, norms and logits do not.
    assert whole / 2 < split < whole * 0.8, (whole, split)
