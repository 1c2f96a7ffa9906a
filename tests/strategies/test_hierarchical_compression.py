"""Hierarchical compressed exchange (``CompressedDDPStrategy(hierarchical=...)``): dense within a node, compressed
across nodes, each parameter sent by one rank of its node; 2 "nodes" of 2 gloo ranks each on this host."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_bigtrain.compression import OneBitAdam
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.engines.compression import GradientCompression, NodeGroups
from lightning_bigtrain.functional.compression import Cast, OneBit, PowerSGD, TopK
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.planning import plan
from lightning_bigtrain.strategies import CompressedDDPStrategy
from lightning_bigtrain.warnings import NoEffectWarning
from tests.functional.test_compression import SHAPES, _grads, _Params
from tests.helpers.distributed import run_on_ranks
from tests.strategies.test_auto_compression import _StopAt
from tests.strategies.test_zero_integration import _MetricsLogger

pytestmark = pytest.mark.integration


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(TypeError, match="hierarchical="):
        CompressedDDPStrategy("powersgd", hierarchical="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"OneBitAdam.*hierarchical=True"):
        CompressedDDPStrategy(OneBitAdam(), hierarchical=True)
    with pytest.raises(ValueError, match="hierarchical=True"):
        CompressedDDPStrategy("onebit_adam", hierarchical=True)


# -- the engine, 2 nodes x 2 ranks --


def _exchange(rank: int, compressors: list[Any], shapes: list[tuple[int, ...]], steps: int) -> list[dict[str, Any]]:
    nodes = NodeGroups.build(local_world=2, num_nodes=2)
    assert (nodes.node, nodes.local_rank) == divmod(rank, 2)
    out = []
    for compressor in compressors:
        module = _Params(shapes)
        engine = GradientCompression(compressor, module, nodes=nodes)
        flat = GradientCompression(compressor, module)  # the flat exchange of the same gradients, for its bytes
        params = list(module.parameters())
        inputs, outputs = [], []
        for step in range(steps):
            grads = _grads(rank, step, shapes, low_rank=True)
            buffer = torch.cat([g.reshape(-1) for g in grads])
            inputs.append(buffer.clone())
            engine.exchange(buffer, engine.segments(buffer, params)).wait()
            outputs.append(buffer)
            engine.advance()
            flat_buffer = torch.cat([g.reshape(-1) for g in grads])
            flat.exchange(flat_buffer, flat.segments(flat_buffer, params)).wait()
            flat.advance()
        engine.close()
        flat.close()
        errors = torch.cat([engine.errors.get(f"ps.{i}", torch.zeros(math.prod(s))).reshape(-1)
                            for i, s in enumerate(shapes)])  # fmt: skip
        out.append({"inputs": inputs, "outputs": outputs, "errors": errors, "owned": sorted(engine.errors),
                    "owners": engine.owners, "sent": engine.sent_bytes, "intra": engine.intra_bytes,
                    "dense": engine.dense_bytes, "flat_sent": flat.sent_bytes,
                    "flat_dense": flat.dense_bytes})  # fmt: skip
    return out


def test_the_average_is_the_global_mean_each_parameter_crosses_nodes_once_and_bytes_follow():
    cases = [
        (TopK(ratio=1.0), 1e-6),  # every entry sent: exact up to summation order
        (PowerSGD(rank=4), 1e-4),  # rank-1 gradients on 4 ranks: the mean has rank <= 4, found exactly
        (Cast("fp16"), 2e-2),  # fp16 keeps 11 significant bits
    ]
    steps = 2
    runs = run_on_ranks(_exchange, [c for c, _ in cases], SHAPES, steps, world_size=4)
    for i, (compressor, atol) in enumerate(cases):
        rs = [r[i] for r in runs]
        for step in range(steps):
            mean = sum(r["inputs"][step] for r in rs) / 4
            for r in rs[1:]:
                assert torch.equal(r["outputs"][step], rs[0]["outputs"][step]), f"{compressor}: replicas differ"
            torch.testing.assert_close(rs[0]["outputs"][step], mean, rtol=0, atol=atol, msg=repr(compressor))
        # Owners: the same map on every rank, both local ranks used, the largest parameter alone on one.
        assert all(r["owners"] == rs[0]["owners"] for r in rs)
        assert set(rs[0]["owners"].values()) == {0, 1} and rs[0]["owners"]["ps.0"] != rs[0]["owners"]["ps.2"]
        # Bytes: the dense reference is the fp32 all-reduce over all 4 ranks; a node's two ranks together send
        # across nodes what one rank of a flat 2-rank exchange would (each parameter once), split between them.
        for r in rs:
            assert r["dense"] == r["flat_dense"]
            assert r["intra"] > 0
        for node in (0, 1):
            a, b = rs[2 * node], rs[2 * node + 1]
            assert 0 < a["sent"] < a["flat_sent"] and 0 < b["sent"] < b["flat_sent"]
            expected = sum(
                (compressor.sent_bytes(torch.Size(s), 4, 2) if compressor.compressible(torch.Size(s))
                 else 4 * math.prod(s) * 2 * (2 - 1) / 2) for s in SHAPES
            ) * steps  # fmt: skip
            assert a["sent"] + b["sent"] == pytest.approx(expected, rel=0.02), repr(compressor)


def test_error_feedback_is_kept_by_the_owner_and_loses_nothing():
    """Each parameter's error buffer lives on its owner only (one per node); over steps, the averaged outputs plus
    the nodes' mean carried error equal the global mean of the inputs (error feedback telescopes on node means)."""
    compressors = [TopK(0.05), OneBit(), PowerSGD(rank=2)]
    runs = run_on_ranks(_exchange, compressors, SHAPES, 3, world_size=4)
    for i, compressor in enumerate(compressors):
        rs = [r[i] for r in runs]
        owners = rs[0]["owners"]
        for rank, r in enumerate(rs):
            compressible = {f"ps.{k}" for k, s in enumerate(SHAPES) if compressor.compressible(torch.Size(s))}
            assert set(r["owned"]) == {n for n in compressible if owners[n] == rank % 2}, repr(compressor)
        sent = sum(rs[0]["outputs"])
        given = sum(sum(r["inputs"][t] for r in rs) / 4 for t in range(3))
        carried = sum(r["errors"] for r in rs) / 2  # per parameter one owner per node: the mean over 2 nodes
        torch.testing.assert_close(sent + carried, given, rtol=0, atol=1e-4, msg=repr(compressor))
        assert (sent - given).abs().max() > 1e-2, f"{compressor} should have left something out"


# -- through the strategy: Trainer(num_nodes=2, devices=2), killed and resumed --


def _fit(rank: int, root: str, hierarchical: bool | None, stop_at: int | None, resume: str | None) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2))  # two "nodes" of two ranks
    L.seed_everything(0, verbose=False)
    logger = _MetricsLogger()
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=6,
                        strategy=CompressedDDPStrategy(PowerSGD(rank=4), hierarchical=hierarchical),
                        limit_val_batches=0, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoint, _StopAt(stop_at)],
                        default_root_dir=root)  # fmt: skip
    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32, warmup_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=16, batch_size=4, subset=256), ckpt_path=resume)
    engine = trainer.strategy.compression_engine
    assert engine is not None
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "nodes": engine.nodes is not None,
        "sent": engine.sent_bytes,
        "intra": engine.intra_bytes,
        "logged": [m for m in logger.metrics if "compression/intra_node_bytes_per_step" in m],
        "warned": [str(w.message) for w in caught],
    }


def test_two_nodes_train_identical_replicas_log_both_byte_counts_and_resume_exactly(tmp_path: Path):
    full = run_on_ranks(_fit, str(tmp_path / "a"), None, None, None, world_size=4, init_process_group=False)
    assert all(r["nodes"] for r in full), "num_nodes=2 x devices=2 should exchange hierarchically by default"
    for r in full[1:]:
        assert torch.equal(r["params"], full[0]["params"])
    assert full[0]["logged"] and full[0]["logged"][-1]["compression/intra_node_bytes_per_step"] > 0
    flat = run_on_ranks(_fit, str(tmp_path / "f"), False, None, None, world_size=4, init_process_group=False)
    assert not flat[0]["nodes"] and not flat[0]["logged"]
    # Across nodes, a node's two ranks together send about one flat rank's bytes (each parameter once, at 2 nodes
    # instead of 4 ranks): per node less than either flat rank.
    assert full[0]["sent"] + full[1]["sent"] < flat[0]["sent"]
    assert not torch.equal(full[0]["params"], flat[0]["params"])  # a different exchange, not a no-op
    # The planner's ddp_powersgd row over 2 nodes x 2 devices: a device's bytes per step, across and within nodes
    # (the owners' shares differ by rank: compared as the mean over the 4 ranks).
    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32)
    row = plan(model, devices=2, num_nodes=2, batch_shape=(4, 16))["ddp_powersgd"]
    measured = sum(r["sent"] + r["intra"] for r in full) / 4 / 6
    assert measured == pytest.approx(row.comm_bytes_per_step, rel=0.02)

    root = tmp_path / "b"
    run_on_ranks(_fit, str(root), None, 3, None, world_size=4, init_process_group=False)
    ckpt = next(root.glob("*step=3.ckpt"))
    resumed = run_on_ranks(_fit, str(root), None, None, str(ckpt), world_size=4, init_process_group=False)
    for rank in range(4):
        assert torch.equal(resumed[rank]["params"], full[rank]["params"]), f"rank {rank} left the trajectory"
    assert not any("dropped" in w for w in resumed[0]["warned"])

    # A flat run resumed hierarchically: the error buffers hold other residuals, so they are dropped, with a warning.
    flat_root = tmp_path / "c"
    run_on_ranks(_fit, str(flat_root), False, 3, None, world_size=4, init_process_group=False)
    ckpt = next(flat_root.glob("*step=3.ckpt"))
    switched = run_on_ranks(_fit, str(flat_root), None, None, str(ckpt), world_size=4, init_process_group=False)
    assert any("hierarchical exchange (2 nodes x 2 ranks)" in w and "dropped" in w for w in switched[0]["warned"])


def _single_node(rank: int) -> list[str]:
    strategy = CompressedDDPStrategy("powersgd", hierarchical=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32),
                    datamodule=ShakespeareDataModule(block_size=16, batch_size=4, subset=64))  # fmt: skip
    assert strategy.compression_engine is not None and strategy.compression_engine.nodes is None
    return [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]


def test_hierarchical_on_one_node_warns_and_runs_flat():
    warned = run_on_ranks(_single_node, init_process_group=False)[0]
    assert any("(hierarchical=True)` has no effect with num_nodes=1" in w for w in warned), warned


def _family(rank: int, family: str, hierarchical: bool) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data

    os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2))
    L.seed_everything(0, verbose=False)
    model = _build(FAMILIES[family], 0)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=4,
                        strategy=CompressedDDPStrategy(PowerSGD(rank=4), hierarchical=hierarchical),
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, datamodule=_data(FAMILIES[family].data))
    engine = trainer.strategy.compression_engine
    assert engine is not None
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "sent": engine.sent_bytes,
            "intra": engine.intra_bytes, "owned": sorted(engine.errors),
            "loss": float(trainer.callback_metrics["train_loss"])}  # fmt: skip


@pytest.mark.parametrize("family", ["hf_gpt2", "timm_vit"])
def test_models_we_did_not_write_train_hierarchically(family):
    """A Hugging Face GPT-2 and a timm ViT built from configs (Conv1D layers; patch embedding, class token): over 2
    nodes x 2 ranks the replicas stay identical, each node's error-feedback buffers are split between its ranks
    (every parameter kept by one owner), and a node's two ranks send fewer bytes across than one rank of the flat
    exchange."""
    pytest.importorskip({"hf_gpt2": "transformers", "timm_vit": "timm"}[family])
    runs = run_on_ranks(_family, family, None, world_size=4, init_process_group=False)
    for r in runs[1:]:
        assert torch.equal(r["params"], runs[0]["params"])
    assert math.isfinite(runs[0]["loss"]) and runs[0]["intra"] > 0
    for node in (runs[:2], runs[2:]):
        owned = [set(r["owned"]) for r in node]
        assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert set(runs[0]["owned"]) | set(runs[1]["owned"]) == set(runs[2]["owned"]) | set(runs[3]["owned"])
    flat = run_on_ranks(_family, family, False, world_size=4, init_process_group=False)
    assert runs[0]["sent"] + runs[1]["sent"] < flat[0]["sent"]
