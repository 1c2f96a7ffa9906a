"""What a LightningModule logs is counted once per batch under tensor and pipeline parallelism, on 2 CPU ranks.

There the ranks of a tensor-parallel group (and the stages of a pipeline) share each batch: the data is split over
the data-parallel ranks only. A sum over all ranks (``self.log(..., reduce_fx="sum", sync_dist=True)``, a
torchmetrics ``SumMetric``, Lightning's ``ThroughputMonitor``) counted each batch once per rank sharing it, silently
(means and ratios hid it), and a pipeline logged the mean of a batch's micro-batch values where the name asked for
their sum."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import ZeroStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_QUIET = dict(accelerator="cpu", devices=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
              enable_checkpointing=False)  # fmt: skip
_TRAIN_BATCHES, _VAL_BATCHES, _BATCH = 4, 3, 8


class _Counting(CharGPT):
    """Logs the samples it sees, summed, and (outside a pipeline, which refuses metric objects) a ``SumMetric``
    of them and an ``Accuracy``."""

    def __init__(self, metrics: bool) -> None:
        super().__init__(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=3)
        self.metrics = metrics
        self.val_count = torchmetrics.SumMetric()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=self.lm_head.out_features)

    def training_step(self, batch, batch_idx):
        self.log(
            "train_samples", float(batch[0].shape[0]), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True
        )
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)), sync_dist=True)
        self.log("val_samples", float(x.shape[0]), reduce_fx="sum", sync_dist=True)
        if self.metrics:
            self.val_count.update(torch.tensor(float(x.shape[0])))
            self.val_acc.update(logits.argmax(-1), y)
            self.log("val_count", self.val_count)
            self.log("val_acc", self.val_acc)


def _strategy(name: str):
    if name == "tp2":
        return ZeroStrategy(stage=3, tensor_parallel=2)
    if name == "pp2":
        return ZeroStrategy(pipeline_parallel=2)
    return ZeroStrategy(stage=3)


def _logged(rank: int, names: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for name in names:
        L.seed_everything(0, verbose=False)
        model = _Counting(metrics=name != "pp2")
        trainer = L.Trainer(strategy=_strategy(name), max_epochs=1, limit_train_batches=_TRAIN_BATCHES,
                            limit_val_batches=_VAL_BATCHES, num_sanity_val_steps=0, **_QUIET)  # fmt: skip
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=_BATCH, subset=256))
        out[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        out[name]["group_given_back"] = model.val_count.process_group is None  # for the module's next strategy
        # Rank counts stay whole: Lightning's votes (EarlyStopping, checkpoint decisions) and an integer sum.
        strategy = trainer.strategy
        out[name]["all_voted"] = strategy.reduce_boolean_decision(True, all=True)
        out[name]["one_voted"] = strategy.reduce_boolean_decision(rank == 0, all=False)
        out[name]["ranks"] = int(strategy.reduce(torch.tensor(1), reduce_op="sum"))
    return out


def test_sums_count_each_batch_once_under_tensor_and_pipeline_parallelism():
    """Before: 64 training and 48 validation samples under tp2 and pp2 (both ranks share each batch of 8), and the
    pipeline's training count the micro-batch mean."""
    for logged in run_on_ranks(_logged, ["zero3", "tp2", "pp2"], init_process_group=False):
        # Data parallel over both ranks: each sees its own batches.
        assert logged["zero3"]["train_samples"] == 2 * _TRAIN_BATCHES * _BATCH
        assert logged["zero3"]["val_samples"] == logged["zero3"]["val_count"] == 2 * _VAL_BATCHES * _BATCH
        for name in ("tp2", "pp2"):  # one data-parallel rank: one stream of batches
            assert logged[name]["train_samples"] == _TRAIN_BATCHES * _BATCH, name
            assert logged[name]["val_samples"] == _VAL_BATCHES * _BATCH, name
        assert logged["tp2"]["val_count"] == _VAL_BATCHES * _BATCH
        for name in logged:
            assert logged[name]["group_given_back"], name
            assert logged[name]["all_voted"] and logged[name]["one_voted"] and logged[name]["ranks"] == 2, name
        assert 0 < logged["tp2"]["val_acc"] < 1


class _Measured(CharGPT):
    """Lightning's ``ThroughputMonitor`` recipe: ``flops_per_batch`` of the whole model on this rank's batch."""

    flops_per_batch = 1e9


def _throughput(rank: int, root: str, names: list[str]) -> dict[str, dict[str, float]]:
    import csv
    import os

    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers import CSVLogger

    out = {}
    for name in names:
        L.seed_everything(0, verbose=False)
        model = _Measured(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=3)
        logger = CSVLogger(os.path.join(root, name), name="", version="")
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], window_size=2)
        quiet = {**_QUIET, "logger": logger}
        trainer = L.Trainer(strategy=_strategy(name), max_steps=3, limit_val_batches=0, log_every_n_steps=1,
                            callbacks=[monitor], **quiet)  # fmt: skip
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=_BATCH, subset=256))
        if rank == 0:
            with open(os.path.join(root, name, "metrics.csv")) as f:
                rows = [r for r in csv.DictReader(f) if r.get("train/device/samples_per_sec")]
            out[name] = {k: float(v) for k, v in rows[-1].items() if v and k.startswith("train/")}
    return out


def test_throughput_monitor_counts_a_shared_batch_once(tmp_path):
    """Before: under tp2 and pp2 (one data-parallel rank) ``samples_per_sec`` was twice the device's, and each
    device was credited with the whole model's FLOPs per batch; data-parallel ZeRO-3 keeps Lightning's numbers."""
    logged = run_on_ranks(_throughput, str(tmp_path), ["zero3", "tp2", "pp2"], init_process_group=False)[0]
    z = logged["zero3"]
    assert z["train/samples_per_sec"] == pytest.approx(2 * z["train/device/samples_per_sec"])
    assert z["train/device/flops_per_sec"] == pytest.approx(1e9 * z["train/device/batches_per_sec"])
    for name in ("tp2", "pp2"):
        m = logged[name]
        assert "train/samples_per_sec" not in m, (name, m)  # one data-parallel rank: as on one device
        assert m["train/device/flops_per_sec"] == pytest.approx(1e9 * m["train/device/batches_per_sec"] / 2), name
