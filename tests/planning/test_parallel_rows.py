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


def test_sequence_parallel_rows_send_its_collectives_and_split_more_activations():
    model = CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32)
    rows = plan(model, devices=2, batch_shape=(4, 32), accelerator="cpu", compression=False)
    tp2, sp = rows["zero3_tp2"], rows["zero3_tp2_sp"]
    assert sp.model_states_bytes == tp2.model_states_bytes
    assert sp.activation_bytes < tp2.activation_bytes  # norms, dropout and residuals split too
    est = estimate_tensor_parallel(model, 2, 2, torch.zeros(4, 32, dtype=torch.long))
    n = 4 * 32 * 64
    # Per block: each column split gathers its input and reduce-scatters its gradient, each row split reduce-scatters
    # its output and gathers its gradient (2 + 2 each, 4 splits); the blocks' activation gathered leaving them and its
    # gradient entering; the norms' weight and bias gradients all-reduced (2 norms x 2 blocks); the embedding and
    # head as without.
    assert sorted(est.sequence_messages) == sorted(
        [("all_gather", n)] * 10 + [("reduce_scatter", n)] * 8 + [("all_reduce", 64)] * 8
        + [("all_reduce", n)] * 2 + [("all_gather", 4 * 32 * 96)])  # fmt: skip
    # The same ring bytes per pair as the all-reduces, plus the container's two gathers and the norms' sums.
    extra = est.tensor_parallel_bytes(4, True) - est.tensor_parallel_bytes(4)
    assert extra == (2 * n + 8 * 64 * 2) / 2 * 4
    assert sp.comm_bytes_per_step - tp2.comm_bytes_per_step == extra
    from lightning_bigtrain.planning.planner import strategy_config

    assert strategy_config("zero3_tp2_sp")["init_args"] == {"stage": 3, "tensor_parallel": 2, "sequence_parallel": True}
    # ZeRO-1/2 on the data axis with sequence parallelism: their own rows' states and holdings, its activations and
    # collectives.
    for stage in (1, 2):
        base, with_sp = rows[f"zero{stage}_tp2"], rows[f"zero{stage}_tp2_sp"]
        assert with_sp.model_states_bytes == base.model_states_bytes
        assert with_sp.activation_bytes == sp.activation_bytes
        assert with_sp.comm_bytes_per_step - base.comm_bytes_per_step == extra
        assert strategy_config(f"zero{stage}_tp2_sp")["init_args"]["stage"] == stage


def test_a_model_sequence_parallelism_refuses_gets_a_note_instead_of_a_row():
    from lightning.pytorch.demos import Transformer

    # Lightning's demo Transformer: its decoder layers take the encoder's memory as a second input (refused by the
    # strategy, so the planner has no row for it either). Its forward needs a target: no fake pass, no example.
    demo = Transformer(vocab_size=33, ninp=32, nhead=2, nhid=64, nlayers=2)
    assert "second input" in str(estimate_tensor_parallel(demo, 2, 2, None).sequence_refused)
    rows = plan(CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32), devices=2, batch_shape=(4, 32),
                accelerator="cpu", compression=False)  # fmt: skip
    assert not any(n.startswith("zero3_tp2_sp:") for n in rows.notes)  # it applies to CharGPT: a row, no note


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


def test_pipeline_rows_hold_each_stages_blocks_and_count_the_messages_exactly():
    from lightning_bigtrain.planning.parallel import estimate_pipeline

    model = CharGPT(n_layer=4, n_head=4, n_embd=64, block_size=32)
    est = estimate_pipeline(model, 2, 2, torch.zeros(8, 32, dtype=torch.long))
    blocks = sum(p.numel() for p in model.blocks.parameters())
    outside = sum(p.numel() for p in model.parameters()) - blocks
    assert est.numel == [outside + blocks // 2] * 2
    # 4 micro-batches of 2 x 32 x 64 fp32 activations: each rank sends one message per micro-batch (stage 0 its
    # outputs, stage 1 its input gradients); the embeddings' and head's gradients are summed once (an all-reduce).
    assert est.hidden_bytes == 2 * 32 * 64 * 4
    assert est.pipeline_bytes(0) == est.pipeline_bytes(1) == 4 * 2 * 32 * 64 * 4
    assert est.reduce_bytes(4) == outside * 4  # 2 (p - 1) / p = 1 at p = 2
    assert est.bubble == 1 / 5
    # 1F1B holds 2 micro-batches on the first rank, 1 on the last; GPipe all 4 on both.
    per_block = est.breakdown["blocks"][0]
    assert est.activations(0) == 2 * (est.breakdown["before"] + 2 * per_block)
    gpipe = estimate_pipeline(model, 2, 2, torch.zeros(8, 32, dtype=torch.long), schedule="gpipe")
    assert gpipe.activations(1) == 4 * (est.breakdown["before"] + 2 * per_block + est.breakdown["after"])
    rows = plan(model, devices=2, batch_shape=(8, 32), accelerator="cpu", compression=False)
    pp2 = rows["zero3_pp2"]
    assert pp2.bubble_fraction == 1 / 5 and pp2.comm_bytes_per_step == est.pipeline_bytes(0) + est.reduce_bytes(4)
    assert pp2.model_states_bytes < rows["ddp"].model_states_bytes * 0.6


def test_a_pipeline_row_is_recommended_only_when_nothing_else_fits():
    from lightning_bigtrain.planning.planner import strategy_config

    assert strategy_config("zero3_pp4") == {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
                                            "init_args": {"stage": 3, "pipeline_parallel": 4}}  # fmt: skip
    model = CharGPT(n_layer=4, n_head=4, n_embd=64, block_size=32)
    roomy = plan(model, devices=2, batch_shape=(8, 32), accelerator="cpu", compression=False)
    assert roomy.recommendation != "zero3_pp2" and any("bubble" in n for n in roomy.notes)
    # Too little memory for anything but the pipeline's stage (states and 1F1B's two micro-batches in flight).
    pp2 = roomy["zero3_pp2"]
    others = min(r.peak_bytes for name, r in roomy.rows.items() if name != "zero3_pp2")
    assert pp2.peak_bytes < others
    tight = plan(model, devices=2, batch_shape=(8, 32), accelerator="cpu", compression=False,
                 device_memory=int((pp2.peak_bytes + others) / 2))  # fmt: skip
    assert tight.recommendation == "zero3_pp2"


def test_a_model_that_cannot_be_cut_gets_no_pipeline_row_and_a_note():
    rows = plan(FashionCNN(), devices=2, accelerator="cpu", compression=False)
    assert "zero3_pp2" not in rows.rows
    assert any(note.startswith("zero3_pp2: not estimated") for note in rows.notes)


def test_pipelines_across_data_parallel_replicas_shard_their_blocks_and_count_zero3_bytes():
    from lightning_bigtrain.planning.parallel import estimate_pipeline

    model = CharGPT(n_layer=4, n_head=4, n_embd=64, block_size=32)
    one = estimate_pipeline(model, 2, 2, torch.zeros(8, 32, dtype=torch.long))
    two = estimate_pipeline(model, 2, 4, torch.zeros(8, 32, dtype=torch.long))
    blocks = sum(p.numel() for p in model.blocks.parameters())
    outside = sum(p.numel() for p in model.parameters()) - blocks
    # Every dimension 0 in CharGPT's blocks is even: the halves are exact.
    assert two.numel == [outside + blocks // 4] * 2 and one.numel == [outside + blocks // 2] * 2
    # Per micro-batch (4): the stage's two blocks gathered twice and reduce-scattered, half of each sent (d = 2).
    assert two.sharding_bytes(0, 4, 4) == 4 * 0.5 * (blocks // 2) * 12
    assert two.reduce_bytes(4) == (1 + 1) * outside * 4 and one.sharding_bytes(0, 4, 4) == 0.0
    rows = plan(model, devices=4, batch_shape=(8, 32), accelerator="cpu", compression=False)
    assert {"zero3_pp2", "zero3_pp4"} <= set(rows.rows)
    assert rows["zero3_pp2"].comm_bytes_per_step == (two.pipeline_bytes(0) + two.reduce_bytes(4)
                                                     + two.sharding_bytes(0, 4, 4))  # fmt: skip
    # ZeRO-1/2 across the pipelines: gathered once per step; reduce-scattered once (1) or per micro-batch (2).
    assert two.sharding_bytes(0, 4, 4, stage=2) == 0.5 * (blocks // 2) * (4 + 4 * 4)
    assert two.sharding_bytes(0, 4, 4, stage=1) == 0.5 * (blocks // 2) * (4 + 4)
    one_, two_, three_ = (rows[f"zero{s}_pp2"] for s in (1, 2, 3))
    assert one_.model_states_bytes == two_.model_states_bytes == three_.model_states_bytes
    assert one_.comm_bytes_per_step < two_.comm_bytes_per_step < three_.comm_bytes_per_step
    # Stage 2 holds the stage's two blocks gathered through the step; stage 3 one block and the prefetched next.
    assert one_.peak_bytes > two_.peak_bytes == three_.peak_bytes
    assert "zero1_pp2" not in plan(model, devices=2, batch_shape=(8, 32), accelerator="cpu", compression=False).rows
