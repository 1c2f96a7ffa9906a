"""Generic tests over the settings table: fit on 2 gloo ranks with identical replicas, exact resume, bad input
rejected."""

from __future__ import annotations

import contextlib
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers.distributed import run_on_ranks
from tests.helpers.settings import SETTINGS, by_name

pytestmark = pytest.mark.integration

_COMMON = dict(
    accelerator="cpu",
    devices=2,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    deterministic=True,
)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: sharded (DTensor) parameters are gathered."""
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else t).detach().reshape(-1).float()


def _gathered(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """DeepSpeed's stage 3 keeps each parameter partitioned between steps: gather them to read them whole."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_tensor")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    with _gathered(model):
        return torch.cat([_full(p) for p in model.parameters()])


def _flat_state(model: torch.nn.Module) -> torch.Tensor:
    """Parameters and buffers (BatchNorm running statistics included)."""
    with _gathered(model):
        return torch.cat([_full(t) for t in model.state_dict().values() if t.is_floating_point()])


class _Interrupt(L.Callback):
    """Stops a run configured for more epochs after ``epochs`` epochs, as a pre-empted job would;
    records the step training started from (to prove a resumed run did not start over)."""

    def __init__(self, epochs: int | None = None) -> None:
        self.epochs = epochs
        self.start_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.epochs is not None and trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def _fit_and_resume(rank: int, name: str, ckpt_dir: str) -> dict:
    setting = by_name(name)
    kwargs = dict(limit_train_batches=3, limit_val_batches=1, **_COMMON)

    def run(stop_after: int | None, ckpt_path: str | None) -> tuple[torch.Tensor, L.LightningModule, L.Trainer]:
        L.seed_everything(0, verbose=False)
        model = setting.model()
        extra = setting.trainer_kwargs()
        probe = _Interrupt(stop_after)
        extra.setdefault("callbacks", []).append(probe)
        if stop_after is not None:
            extra["callbacks"].append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
        trainer = L.Trainer(max_epochs=2, enable_checkpointing=stop_after is not None, **kwargs, **extra)
        trainer.fit(model, datamodule=setting.data(), ckpt_path=ckpt_path)
        assert trainer.global_step == 3 * (stop_after or 2)
        assert probe.start_step == (3 if ckpt_path else 0), "the resumed run did not continue from step 3"
        return _flat_state(model), model, trainer

    uninterrupted, model, trainer = run(None, None)
    run(1, None)
    resumed, _, _ = run(None, f"{ckpt_dir}/last.ckpt")
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "weights": _flat_params(model),
        "loss": float(trainer.callback_metrics["train_loss"]),
    }


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_fits_with_identical_replicas_and_resumes_where_the_uninterrupted_run_ends(setting, tmp_path):
    """One spawn per row (process start-up dominates a tiny fit): a 2-epoch fit on 2 ranks, then the same run
    stopped after epoch 1 and resumed from its checkpoint."""
    results = run_on_ranks(_fit_and_resume, setting.name, str(tmp_path), init_process_group=False)
    for r in results:
        assert math.isfinite(r["loss"])
        torch.testing.assert_close(r["resumed"], r["uninterrupted"], rtol=0, atol=setting.resume_atol)
    # Data-parallel replicas must hold bit-identical parameters (buffers such as BatchNorm statistics
    # are per rank between DDP's broadcasts).
    assert torch.equal(results[0]["weights"], results[1]["weights"])


_BAD = [(s, b) for s in SETTINGS for b in s.bad_inputs]


@pytest.mark.parametrize(("setting", "bad"), _BAD, ids=[f"{s.name}-{b.id}" for s, b in _BAD])
def test_rejects_bad_input(setting, bad):
    with pytest.raises(bad.error, match=bad.match):
        bad.call()
