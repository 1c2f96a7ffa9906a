"""BF16Precision in real 2-rank fits: everything in bf16, compensation buffers sharded with the optimizer."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_bigtrain.callbacks import RunReport
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.functional.bf16 import COMPENSATION_KEY
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.plugins import BF16Precision
from lightning_bigtrain.strategies import ZeroStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def _fit(rank: int, strategy_name: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, warmup_steps=2)
    psi = sum(p.numel() for p in model.parameters())
    strategy = "ddp" if strategy_name == "ddp" else ZeroStrategy(stage=int(strategy_name[-1]), min_wrap_params=1000)
    report = RunReport(verbose=False, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[BF16Precision("kahan")],
                        max_steps=3, limit_val_batches=0, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[report])  # fmt: skip
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=64))
    optimizer = trainer.optimizers[0]
    states = list(optimizer.state.values())
    return {
        "params": {p.dtype for p in model.parameters()},
        "moments": {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")},
        "compensation": {s[COMPENSATION_KEY].dtype for s in states},
        "compensation_numel": sum(_local_numel(s[COMPENSATION_KEY]) for s in states),
        "psi": psi,
        "bytes_per_param": report.report["model_state_bytes_per_rank"][rank] / psi if rank == 0 else None,
    }


@pytest.mark.parametrize(("strategy", "bytes_per_param"), [("ddp", 10.0), ("zero2", 6.0), ("zero3", 5.0)])
def test_everything_is_bf16_and_the_kahan_buffers_are_sharded_with_the_optimizer(strategy, bytes_per_param):
    """AdamW with Kahan: bf16 weights 2 + gradients 2 + two moments 4 + buffer 2 = 10 bytes per parameter;
    ZeRO-2 on 2 ranks shards all but the weights (2 + 8/2 = 6), ZeRO-3 everything (10/2 = 5)."""
    results = run_on_ranks(_fit, strategy, init_process_group=False)
    for r in results:
        assert r["params"] == r["moments"] == r["compensation"] == {torch.bfloat16}
        sharded = strategy != "ddp"
        assert r["compensation_numel"] == (r["psi"] // 2 if sharded else r["psi"])
    assert results[0]["bytes_per_param"] == pytest.approx(bytes_per_param, rel=0.02)
