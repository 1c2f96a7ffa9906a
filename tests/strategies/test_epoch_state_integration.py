"""A resumed fit ends each epoch and validation with the uninterrupted run's logged values and metric states.

Lightning 2.6 saves neither the epoch aggregates of ``self.log(..., on_epoch=True)`` nor torchmetrics' states (not in
the module's ``state_dict``): after a mid-epoch resume an epoch mean covered only the batches after it, a value
logged in ``on_train_epoch_start`` was missing, a metric had counted a part of the epoch (one counting the whole run
restarted from zero after any checkpoint), and a plateau scheduler on the epoch loss went another way.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.callbacks import FaultTolerance
from lightning_bigtrain.strategies import ZeroStrategy
from lightning_bigtrain.warnings import BigtrainWarning
from tests.helpers.distributed import run_on_ranks


class _Crash(Exception):
    """A job killed right after a checkpoint's commit."""


class _Logged(L.LightningModule):
    """Logs epoch aggregates of every reduction (each rank its own values: ``rank_offset`` apart), one of them in
    ``on_train_epoch_start``, torchmetrics metrics logged as values in training and validation (Lightning resets them
    at their loop's end) and one kept aside, never reset; a plateau scheduler on the epoch loss. Records each epoch's
    and validation's end as a monitor sees it. ``crash_at``: raise in the first hook after the checkpoint of that
    step."""

    def __init__(self, crash_at: int | None = None, rank_offset: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.mean_abs = torchmetrics.MeanMetric()
        self.seen = torchmetrics.SumMetric()
        self.val_mean = torchmetrics.MeanMetric()
        self.crash_at = crash_at
        self.rank_offset = rank_offset
        self.armed = False
        self.epochs: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self.prog_bar = False

    def on_save_checkpoint(self, checkpoint) -> None:
        self.armed = self.global_step == self.crash_at

    def _next(self) -> None:
        if self.armed:
            raise _Crash()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._next()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._next()  # the module's hook follows ModelCheckpoint's (callbacks first)

    def on_train_epoch_start(self) -> None:
        self._next()
        self.log("started", float(self.current_epoch + 1), on_epoch=True, reduce_fx="sum")

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = (self.layer(x) - y).pow(2).mean()
        local = loss + self.global_rank * self.rank_offset
        self.log("loss", loss, on_epoch=True, sync_dist=True)
        self.log("index_mean", index.float().mean(), on_epoch=True, sync_dist=True)  # 11.5 over any whole epoch
        self.log("local_mean", local, on_epoch=True)
        self.log("local_max", local, on_epoch=True, reduce_fx="max")
        self.log("local_min", local, on_epoch=True, reduce_fx=min)
        self.log("local_sum", local, on_epoch=True, reduce_fx="sum", prog_bar=self.prog_bar)
        self.mean_abs.update(self.layer(x).abs().mean())
        self.log("mean_abs", self.mean_abs, on_epoch=True)
        self.seen.update(index.sum())
        return loss

    def on_train_epoch_end(self) -> None:
        self._next()

    def validation_step(self, batch, batch_idx) -> None:
        x, y, _ = batch
        loss = (self.layer(x) - y).pow(2).mean()
        self.log("val_loss", loss, sync_dist=True)
        self.val_mean.update(loss)
        self.log("val_mean", self.val_mean)

    def on_validation_end(self) -> None:
        self._next()  # after ModelCheckpoint's on_validation_end

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0, threshold=0.0)
        return [optimizer], [{"scheduler": plateau, "monitor": "loss", "interval": "epoch"}]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g) * torch.arange(24.0).unsqueeze(1) / 4
        data = torch.utils.data.TensorDataset(x, y, torch.arange(24))  # seen sums the indices of the samples drawn
        return torch.utils.data.DataLoader(data, batch_size=2)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g),
                                              torch.arange(4))  # fmt: skip
        return torch.utils.data.DataLoader(data, batch_size=2)


class _EpochEnds(L.Callback):
    """What a monitor sees at each epoch's and validation's end (before a checkpoint written there), and the metric
    kept aside (never reset: it counts the whole run)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("val")}
        pl_module.epochs.append({**row, "seen": float(pl_module.seen.compute())})

    def on_validation_end(self, trainer, pl_module) -> None:
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        pl_module.validations.append({**row, "step": trainer.global_step})


# Where the checkpoints are written: at every step's end; at each epoch's end (ModelCheckpoint's default without
# validation); at the end of each validation (every 4 steps), monitoring its loss.
_CHECKPOINTS = {
    "steps": ({"every_n_train_steps": 1}, {"limit_val_batches": 0}),
    "epoch": ({}, {"limit_val_batches": 0}),
    "validation": ({"monitor": "val_loss", "save_top_k": -1}, {"val_check_interval": 4, "num_sanity_val_steps": 0}),
}


def _fit(
    folder: Path, strategy: str, devices: int, crash_at: int | None, ckpt_path: str | None, offset: float = 0.0,
    kind: str = "steps",
):  # fmt: skip
    L.seed_everything(0, verbose=False)
    model = _Logged(crash_at, offset)
    strategies = {"ddp": "ddp", "zero1": ZeroStrategy(stage=1), "zero3": ZeroStrategy(stage=3)}
    checkpoint, validation = _CHECKPOINTS[kind]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategies[strategy], max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, **validation,
        callbacks=[*([FaultTolerance()] if strategy == "ddp" else []), _EpochEnds(),
                   ModelCheckpoint(dirpath=folder, save_last=True, **checkpoint)],
    )  # fmt: skip
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except _Crash:
        assert crash_at is not None
    return trainer, model


def _state(trainer, model) -> dict:
    return {
        "epochs": model.epochs,
        "validations": model.validations,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "weights": {k: v.clone() for k, v in model.layer.state_dict().items()},
    }


@pytest.mark.usefixtures("in_process_fit")
@pytest.mark.parametrize(
    ("kind", "crash_at", "ended"),
    [("steps", 3, 0), ("steps", 12, 0), ("steps", 15, 1), ("epoch", 12, 1), ("validation", 4, 0)],
    ids=["mid-epoch", "last-batch", "later", "epoch-end", "validation-end"],
)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_resume_ends_each_epoch_and_validation_with_the_uninterrupted_values(
    tmp_path, strategy, kind, crash_at, ended
):
    """Checkpoints inside an epoch (at a step's end, a validation's end) and at its end: the crashed and the resumed
    job together see every epoch's and validation's values of the uninterrupted run, once. A metric Lightning resets
    right after the hook that wrote the checkpoint (logged in training, at the epoch's end; logged in the validation,
    at its end) resumes reset; one never reset resumes with its count."""
    reference = _state(*_fit(tmp_path / "ref", strategy, 1, None, None, kind=kind))
    _, crashed = _fit(tmp_path / "run", strategy, 1, crash_at, None, kind=kind)
    assert len(crashed.epochs) == ended  # epochs of 12 batches
    resumed = _state(*_fit(tmp_path / "run", strategy, 1, None, "last", kind=kind))
    assert crashed.epochs + resumed["epochs"] == reference["epochs"]
    assert crashed.validations + resumed["validations"] == reference["validations"]
    assert len(reference["validations"]) == (6 if kind == "validation" else 0)
    assert resumed["lr"] == reference["lr"]
    assert reference["lr"] < 0.01  # the plateau scheduler acted
    for name, value in reference["weights"].items():
        assert torch.equal(value, resumed["weights"][name]), name


@pytest.mark.usefixtures("in_process_fit")
def test_a_value_logged_with_other_arguments_after_the_relaunch_drops_its_restored_aggregate(tmp_path, monkeypatch):
    """The user switched ``prog_bar`` on for one value before relaunching: Lightning would refuse the call against the
    restored entry ("twice ... with different arguments"); the restored aggregate is dropped with a warning, the
    others are kept."""
    reference = _state(*_fit(tmp_path / "ref", "ddp", 1, None, None))
    _fit(tmp_path / "run", "ddp", 1, 3, None)
    original = _Logged.__init__

    def changed(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.prog_bar = True

    monkeypatch.setattr(_Logged, "__init__", changed)
    with pytest.warns(BigtrainWarning, match=r"`self.log\('local_sum', ...\)` in `training_step` now has other argu"):
        resumed = _state(*_fit(tmp_path / "run", "ddp", 1, None, "last"))
    first, expected = resumed["epochs"][0], reference["epochs"][0]
    assert first["local_sum"] < expected["local_sum"]  # the batches after the resume only
    kept = [k for k in expected if not k.startswith("local_sum")]
    assert [first[k] for k in kept] == [expected[k] for k in kept]


def _on_ranks(rank: int, folder: str, devices: int, crash_at: int | None, ckpt_path: str | None) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BigtrainWarning)
        trainer, model = _fit(Path(folder), "zero1", devices, crash_at, ckpt_path, offset=100.0)
    out = _state(trainer, model)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, BigtrainWarning)]
    return out


def test_every_rank_resumes_its_own_epoch_values_and_another_world_size_merges_the_synced_ones(tmp_path):
    """Two ranks log different values (``rank_offset``): each resumes its own. Resumed at one rank, the values
    synced at the epoch's end (``sync_dist=True``, torchmetrics' sum and mean) are merged onto it: the epoch's synced
    values are the two ranks' together; the rank-local ones are rank 0's, with a warning naming them."""
    ref = run_on_ranks(_on_ranks, str(tmp_path / "ref"), 2, None, None, init_process_group=False)
    run_on_ranks(_on_ranks, str(tmp_path / "run"), 2, 2, None, init_process_group=False)  # step 2 of 6 per epoch
    for name in ("same", "one"):
        shutil.copytree(tmp_path / "run", tmp_path / name, symlinks=True)
    same = run_on_ranks(_on_ranks, str(tmp_path / "same"), 2, None, "last", init_process_group=False)
    for rank in (0, 1):
        assert same[rank]["epochs"] == ref[rank]["epochs"], rank  # each rank's own local values
        assert same[rank]["lr"] == ref[rank]["lr"]
        assert same[rank]["warnings"] == []
        for name, value in ref[rank]["weights"].items():
            assert torch.equal(value, same[rank]["weights"][name])
    assert ref[0]["epochs"][0]["local_mean"] != ref[1]["epochs"][0]["local_mean"]

    (one,) = run_on_ranks(_on_ranks, str(tmp_path / "one"), 1, None, "last", world_size=1, init_process_group=False)
    first, expected = one["epochs"][0], ref[0]["epochs"][0]
    # The epoch's samples are the same (the sampler's global cursor is re-partitioned); the weights after step 2
    # differ (one rank's larger batches), so only what does not depend on them is compared exactly.
    assert first["seen"] == expected["seen"] == sum(range(24))  # merged sums: every sample of the epoch once
    assert first["index_mean"] == expected["index_mean"] == 11.5  # merged means
    assert first["started"] == expected["started"] == 1.0  # rank-local: rank 0's own
    assert any("local_mean" in w and "rank-local" in w for w in one["warnings"]), one["warnings"]
    assert not any("'loss'" in w for w in one["warnings"])  # synced: merged, not reported


class _Unmergeable(torchmetrics.Metric):
    """A state reduced by a mean across ranks: another partition of the ranks changes its value."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("level", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, value: torch.Tensor) -> None:
        self.level = value

    def compute(self) -> torch.Tensor:
        return self.level


def test_metric_states_of_more_ranks_merge_onto_rank_0_by_their_reduction_or_stay_rank_local():
    from lightning_bigtrain.strategies._epoch_state import _load_metric_states, _metric_states, _repartition_metrics

    def module() -> torch.nn.Module:
        m = torch.nn.Module()
        m.cat, m.max, m.min = torchmetrics.CatMetric(), torchmetrics.MaxMetric(), torchmetrics.MinMetric()
        m.level = _Unmergeable()
        return m

    parts = []
    for values in ([1.0, 5.0], [3.0], [-2.0, 4.0]):  # three saved ranks
        m = module()
        for v in values:
            for metric in (m.cat, m.max, m.min, m.level):
                metric.update(torch.tensor(v))
        parts.append(_metric_states(m, set()))
    with pytest.warns(BigtrainWarning, match=r"written by 3 ranks, this run has 2.*\['level'\] are rank-local"):
        first = _repartition_metrics(module(), parts, 0, 2)
    second = _repartition_metrics(module(), parts, 1, 2)
    on_0, on_1 = module(), module()
    _load_metric_states(on_0, first)
    _load_metric_states(on_1, second)
    assert sorted(on_0.cat.compute().tolist()) == [-2.0, 1.0, 3.0, 4.0, 5.0]
    assert (float(on_0.max.compute()), float(on_0.min.compute())) == (5.0, -2.0)
    assert float(on_0.level.compute()) == 5.0 and float(on_1.level.compute()) == 3.0  # saved ranks 0 and 1
    assert on_1.cat.update_count == 0 and on_1.max.update_count == 0  # empty: rank 0 holds the merged states

    other = module()
    other.cat = torchmetrics.SumMetric()  # another metric under the saved one's name
    with pytest.warns(BigtrainWarning, match=r"states of metric 'cat' \(\['value'\]\) are not those of this run's "):
        _load_metric_states(other, parts[0])
    assert other.cat.update_count == 0 and float(other.max.compute()) == 5.0  # the others are loaded


def test_logged_values_of_more_ranks_merge_onto_rank_0_and_the_other_ranks_start_them_empty():
    from lightning_bigtrain.strategies._epoch_state import _repartition_results

    def record(name: str, reduce: str, value: float, sync: bool, count: int | None = None) -> dict:
        out = {"name": name, "reduce": reduce, "value": torch.tensor(value), "tensor": True, "sync": sync,
               "rank_zero_only": False}  # fmt: skip
        return out if count is None else {**out, "count": count}

    saved = [  # three saved ranks: a synced mean (value x batch size summed, and the count), a synced max, a local sum
        {"m": record("m", "mean", 6.0, True, 3), "x": record("x", "builtins.max", 2.0, True),
         "s": record("s", "sum", 1.0, False)},
        {"m": record("m", "mean", 4.0, True, 2), "x": record("x", "builtins.max", 7.0, True),
         "s": record("s", "sum", 10.0, False)},
        {"m": record("m", "mean", 5.0, True, 5), "x": record("x", "builtins.max", 3.0, True),
         "s": record("s", "sum", 100.0, False)},
    ]  # fmt: skip
    with pytest.warns(BigtrainWarning, match=r"written by 3 ranks, this run has 2.*\['s'\] are rank-local"):
        first = _repartition_results(saved, 0, 2)
    second = _repartition_results(saved, 1, 2)
    assert (float(first["m"]["value"]), first["m"]["count"], float(first["x"]["value"])) == (15.0, 10, 7.0)
    assert (float(second["m"]["value"]), second["m"]["count"], float(second["x"]["value"])) == (0.0, 0, float("-inf"))
    assert (float(first["s"]["value"]), float(second["s"]["value"])) == (1.0, 10.0)  # by rank index
    assert float(saved[0]["m"]["value"]) == 6.0  # the saved records are left as they were
