"""The planner against the strategies themselves: 2 CPU ranks, the same model, measured vs predicted."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_bigtrain.callbacks import RunReport
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.planning import plan
from lightning_bigtrain.strategies import CompressedDDPStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_STEPS = 4


def _model() -> CharGPT:
    return CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, warmup_steps=2)


class _CommPerStep(L.Callback):
    """Bytes the strategy counted from the second step to the end, per step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.start = trainer.strategy.comm_bytes

    def on_train_end(self, trainer, pl_module):
        self.per_step = (trainer.strategy.comm_bytes - self.start) / (_STEPS - 1)


def _measure(rank: int, name: str) -> dict:
    L.seed_everything(0, verbose=False)
    base, _, compression = name.partition("_")
    if base == "ddp":
        strategy: Any = CompressedDDPStrategy(compression) if compression else "ddp"
    else:
        strategy = ZeroStrategy(stage=int(base[-1]), min_wrap_params=1000, compression=compression or None)
    report = RunReport(verbose=False, warmup_steps=0)
    callbacks: list[L.Callback] = [report] + ([_CommPerStep()] if name != "ddp" else [])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=_STEPS, limit_val_batches=0,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(_model(), datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=128))
    engine = getattr(trainer.strategy, "compression_engine", None)
    error_bytes = sum(t.numel() * t.element_size() for t in engine.errors.values()) if engine else 0
    return {
        "states": report.report["model_state_bytes_per_rank"][rank] + error_bytes,
        "comm": callbacks[-1].per_step if name != "ddp" else None,
    }


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "ddp_powersgd", "zero1_topk", "zero2_fp16"])
def test_predictions_match_what_the_strategies_hold_and_send(name):
    predicted = plan(_model(), devices=2, accelerator="cpu", batch_shape=(8, 32))[name]
    for measured in run_on_ranks(_measure, name, init_process_group=False):
        # Model states within 10% (the bound); they agree exactly here, padding included.
        assert measured["states"] == pytest.approx(predicted.model_states_bytes, rel=0.10)
        if measured["comm"] is not None:
            assert measured["comm"] == pytest.approx(predicted.comm_bytes_per_step, rel=1e-9)
