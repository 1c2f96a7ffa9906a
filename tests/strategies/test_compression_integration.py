"""Compression that cannot act in a run says so (NoEffectWarning) and the run exchanges gradients densely."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import CompressedDDPStrategy, ZeroStrategy
from lightning_bigtrain.warnings import NoEffectWarning
from tests.helpers.distributed import run_on_ranks
from tests.strategies.test_zero_integration import _MetricsLogger

pytestmark = pytest.mark.integration


class _GradDtypes(L.Callback):
    def __init__(self) -> None:
        self.reduced: set[torch.dtype] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.reduced |= {p.grad.dtype for g in optimizer.param_groups for p in g["params"] if p.grad is not None}


def _fit(rank: int, kind: str, precision: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    devices = 1 if kind == "ddp_single" else 2
    strategy: Any
    if kind == "ddp_single":
        strategy = CompressedDDPStrategy("powersgd", start_method="popen")
    elif kind == "ddp_cast":
        strategy = CompressedDDPStrategy("fp16", start_method="popen")
    else:
        strategy = ZeroStrategy(stage=int(kind[-1]), compression="fp16", min_wrap_params=1000)
    dtypes = _GradDtypes()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=2,
                        limit_val_batches=0, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[dtypes])  # fmt: skip
    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32, warmup_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=16, batch_size=4, subset=64))
    return {
        "warned": [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)],
        "engine": trainer.strategy.compression_engine is not None,
        "grads": sorted(str(d) for d in dtypes.reduced),
        "finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
    }


def test_single_process_compression_warns_and_trains_densely():
    r = run_on_ranks(_fit, "ddp_single", "32-true", world_size=1, init_process_group=False)[0]
    assert any("has no effect in a single process" in m for m in r["warned"]), r["warned"]
    assert not r["engine"] and r["finite"]


def _fits(rank: int, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    from lightning_bigtrain import warnings as bt_warnings

    out = []
    for kind, precision in runs:
        bt_warnings._seen.clear()  # each fit may warn again
        out.append(_fit(rank, kind, precision))
    return out


def test_cast_warns_only_when_the_gradients_are_16_bit_already():
    runs = [("ddp_cast", "bf16-true"), ("zero2", "bf16-true"), ("zero3", "bf16-true"), ("zero2", "32-true")]
    per_rank = run_on_ranks(_fits, runs, init_process_group=False)
    for i, (kind, precision) in enumerate(runs):
        results = [ranks[i] for ranks in per_rank]
        if precision == "32-true":
            assert not any(r["warned"] for r in results), kind
            continue
        # Rank 0 warns; every rank trains on, its gradients exchanged as they are (bf16, not cast to fp16).
        assert any("the gradients are bfloat16 already" in m for m in results[0]["warned"]), (kind, results[0])
        for r in results:
            assert not r["engine"] and r["finite"]
            assert r["grads"] == ["torch.bfloat16"], kind


# -- ZeRO-2 with a compressor: the compressed reduce-scatter --


def _zero2(rank: int, compressions: tuple[Any, ...]) -> dict[str, dict[str, Any]]:
    from benchmarks.common import count_collectives

    out = {}
    for compression in compressions:
        L.seed_everything(0, verbose=False)
        logger = _MetricsLogger()
        strategy = ZeroStrategy(stage=2, compression=compression, min_wrap_params=1000)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, limit_val_batches=0,
                            enable_checkpointing=False, logger=logger, log_every_n_steps=3, enable_progress_bar=False,
                            enable_model_summary=False, gradient_clip_val=0.5)  # fmt: skip
        model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32, warmup_steps=2)
        with count_collectives(2, ("reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                                   "all_gather_single", "all_to_all_single")) as counted:  # fmt: skip
            trainer.fit(model, datamodule=ShakespeareDataModule(block_size=16, batch_size=4, subset=64))
        engine = trainer.strategy.compression_engine
        out[repr(compression)] = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "engine": None if engine is None else {"sent": engine.sent_bytes, "dense": engine.dense_bytes},
            "own": trainer.strategy.comm_bytes,
            "counted": counted["bytes"],
            "memory": dict(trainer.strategy.memory),
            "ratios": [m["compression/ratio"] for m in logger.metrics if "compression/ratio" in m],
        }
    return out


def test_zero2_compressed_reduce_scatter_trains_keeps_replicas_and_counts_its_bytes():
    from lightning_bigtrain.compression import OneBit, TopK

    runs = run_on_ranks(_zero2, (None, TopK(ratio=1.0), OneBit()), init_process_group=False)
    dense, everything, onebit = (runs[0][k] for k in ("None", repr(TopK(ratio=1.0)), repr(OneBit())))
    for key in runs[0]:
        assert torch.equal(runs[0][key]["params"], runs[1][key]["params"]), f"{key}: replicas differ"
    # Every entry sent: the same training as the dense reduce-scatter (summation order aside).
    torch.testing.assert_close(everything["params"], dense["params"], rtol=0, atol=1e-5)
    assert not torch.allclose(onebit["params"], dense["params"], atol=1e-4)  # 1 bit does change the run
    # Bytes: the engine's count of the reduce-scatter against a dense fp32 one, > 16x (1 bit: ~32x at N=2); the
    # strategy's total (engine + the parameters' all-gather) equals an independent count of the collectives.
    e = onebit["engine"]
    assert e["dense"] / e["sent"] > 16, e
    assert onebit["own"] == pytest.approx(onebit["counted"], abs=8 * 6)  # + the 4-byte finite flag per step
    assert onebit["ratios"] and all(r > 16 for r in onebit["ratios"])
    # Model state: one fp32 error buffer per trainable entry, per rank, counted with the rest.
    assert onebit["memory"]["compression"] == 4 * onebit["trainable"]
    assert "compression" not in dense["memory"]
    assert onebit["memory"]["total"] == dense["memory"]["total"] + 4 * onebit["trainable"]


class _WithUnusedLayer(L.LightningModule):
    """A model with a layer its step never uses: DDP needs ``find_unused_parameters=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out, self.unused = torch.nn.Linear(8, 64), torch.nn.Linear(64, 1), torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.hidden(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _unused(rank: int) -> dict[str, Any]:
    from lightning_bigtrain.compression import Cast

    out: dict[str, Any] = {}
    for name in ("ddp", "fp16"):
        L.seed_everything(0, verbose=False)
        model = _WithUnusedLayer()
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g))
        strategy = ("ddp_find_unused_parameters_true" if name == "ddp"
                    else CompressedDDPStrategy(Cast("fp16"), find_unused_parameters=True))  # fmt: skip
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
        out[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def test_find_unused_parameters_trains_like_ddp():
    """The exchange thread and DDP's all-reduce of its used-parameter map shared one process group: gloo aborted both
    ranks ("collective mismatch"). The exchange has a group of its own."""
    for r in run_on_ranks(_unused, init_process_group=False):
        torch.testing.assert_close(r["fp16"], r["ddp"], rtol=1e-3, atol=1e-4)
