"""``activation_checkpointing=True`` on 2 CPU ranks: the char-GPT with dropout ends bit-identical to the same run
without it (weights and validation loss), under ZeRO-2 and ZeRO-3 on the torch engine, DeepSpeed's stage 3, a
2-stage pipeline and compressed DDP (PowerSGD); the live bytes of a training step, from the allocator's events,
fall to about a third. Before, the planner counted checkpointed activations (``bigtrain plan
--activation-checkpointing``) that no strategy of this package could produce."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch

from lightning_bigtrain.compression import PowerSGD
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import CompressedDDPStrategy, DeepSpeedZeroStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.helpers.memory import AllocationTimeline

pytestmark = pytest.mark.integration

_LAYOUTS = ["zero2", "zero3", "ds3", "pp2", "powersgd"]


class _Marks(L.Callback):
    def __init__(self, timeline: AllocationTimeline) -> None:
        self.timeline = timeline

    def on_train_batch_start(self, *args: Any) -> None:
        self.timeline.mark("step")


def _strategy(layout: str, checkpointing: Any) -> Any:
    if layout == "powersgd":
        return CompressedDDPStrategy(PowerSGD(rank=2), activation_checkpointing=checkpointing)
    if layout == "ds3":
        return DeepSpeedZeroStrategy(3, activation_checkpointing=checkpointing)
    if layout == "pp2":
        return ZeroStrategy(pipeline_parallel=2, activation_checkpointing=checkpointing)
    return ZeroStrategy(stage=int(layout[-1]), min_wrap_params=1000, activation_checkpointing=checkpointing)


def _fit(layout: str, checkpointing: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.1, warmup_steps=2)
    strategy = _strategy(layout, checkpointing)
    timeline = AllocationTimeline()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, limit_val_batches=1,
                        num_sanity_val_steps=0, val_check_interval=3, callbacks=[_Marks(timeline)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(), timeline:
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=64, batch_size=8, subset=1024))
    at, peak = timeline.live_bytes()
    if layout == "ds3":
        import deepspeed

        params = list(trainer.strategy.model.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights = torch.cat([p.detach().reshape(-1).clone() for p in params])
    else:
        weights = torch.cat(
            [getattr(p, "full_tensor", lambda p=p: p)().detach().reshape(-1) for p in model.parameters()]
        )
    return {"weights": weights, "step_bytes": peak["step"] - at["step"], "blocks": strategy.checkpointed_blocks,
            "val": float(trainer.callback_metrics["val_loss"])}  # fmt: skip


def _runs(rank: int) -> dict[str, Any]:
    out = {layout: (_fit(layout, False), _fit(layout, True)) for layout in _LAYOUTS}
    try:
        _fit("zero3", {torch.nn.GRU})
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_checkpointed_runs_end_bit_identical_with_fewer_live_bytes_per_step():
    results = run_on_ranks(_runs, init_process_group=False)
    for layout in _LAYOUTS:
        for rank, r in enumerate(results):
            plain, checkpointed = r[layout]
            assert checkpointed["blocks"] == [f"blocks.{i}" for i in range(4)] and plain["blocks"] == []
            torch.testing.assert_close(checkpointed["weights"], plain["weights"], rtol=0, atol=0, msg=layout)
            assert checkpointed["val"] == plain["val"], layout
            ratio = checkpointed["step_bytes"] / plain["step_bytes"]
            print(f"{layout} rank {rank}: live bytes per step {plain['step_bytes'] / 1e6:.1f} MB -> "
                  f"{checkpointed['step_bytes'] / 1e6:.1f} MB ({ratio:.2f}x)")  # fmt: skip
            # (the pipeline's last stage also holds the head's logits and the loss, which no block holds)
            assert ratio < (0.75 if layout == "pp2" else 0.5), (layout, rank, ratio)
    assert "activation_checkpointing={GRU}" in results[0]["refused"], results[0]["refused"]
