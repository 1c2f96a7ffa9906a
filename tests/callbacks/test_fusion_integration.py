"""OperatorFusion in real fits: compile after the strategy wraps the model, the fused optimizer, the auto choice."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_bigtrain.callbacks import OperatorFusion
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.warnings import BigtrainWarning
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_COMMON = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip


def _model() -> CharGPT:
    return CharGPT(block_size=16, n_layer=2, n_head=2, n_embd=32, warmup_steps=2)


def _data() -> ShakespeareDataModule:
    return ShakespeareDataModule(block_size=16, batch_size=8, subset=512)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.chunked: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.chunked.append(bool(getattr(pl_module, "fused_lm_head_loss", False)))


def _ddp_runs(rank: int) -> dict:
    out = {}
    for name, callbacks in (("eager", []), ("fused", [OperatorFusion("regional")])):
        L.seed_everything(0, verbose=False)
        losses = _Losses()
        model = _model()
        trainer = L.Trainer(devices=2, strategy="ddp", max_steps=8, callbacks=[*callbacks, losses], **_COMMON)
        trainer.fit(model, datamodule=_data())
        out[name] = losses.losses
        out[f"{name}_weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[f"{name}_optimizer_fused"] = bool(trainer.optimizers[0].param_groups[0].get("fused"))
        out[f"{name}_compiled"] = [type(m).__name__ for m in callbacks[0]._compiled] if callbacks else []
    return out


def test_regional_compile_after_ddp_wraps_and_fused_optimizer_train_like_eager():
    """Blocks compiled inside DDP's wrapper and AdamW on its fused kernel: the same losses as eager to rounding
    (compiled kernels and the fused update round differently: 1e-4 relative over 8 steps), and replicas stay
    bit-identical."""
    results = run_on_ranks(_ddp_runs, init_process_group=False)
    for r in results:
        assert r["fused_optimizer_fused"] and not r["eager_optimizer_fused"]
        assert r["fused_compiled"] == ["Block", "Block"]
        torch.testing.assert_close(torch.tensor(r["fused"]), torch.tensor(r["eager"]), rtol=1e-4, atol=0)
    assert torch.equal(results[0]["fused_weights"], results[1]["fused_weights"])


def test_auto_times_the_candidates_and_keeps_the_fastest():
    L.seed_everything(0, verbose=False)
    fusion = OperatorFusion("auto", warmup_steps=1, trial_steps=2)
    trainer = L.Trainer(devices=1, max_steps=10, callbacks=[fusion], **_COMMON)
    trainer.fit(_model(), datamodule=_data())
    assert set(fusion.timings) == {"off", "regional", "full"}
    best = min(fusion.timings, key=fusion.timings.__getitem__)
    # Kept: the fastest if it beats eager by min_gain, else eager.
    expected = best if fusion.timings[best] < fusion.timings["off"] * (1 - fusion.min_gain) else "off"
    assert fusion.choice == expected
    assert trainer.global_step == 10  # the trials were training steps


class _Branchy(CharGPT):
    """Data-dependent control flow in forward: TorchDynamo breaks the graph there."""

    def forward(self, idx):
        logits = super().forward(idx)
        if logits.mean() > 0:  # depends on the values
            return logits * 1.0
        return logits


def test_graph_breaks_are_reported():
    L.seed_everything(0, verbose=False)
    fusion = OperatorFusion("full", fused_optimizer=False)
    trainer = L.Trainer(devices=1, max_steps=2, callbacks=[fusion], **_COMMON)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Branchy(block_size=16, n_layer=1, n_head=2, n_embd=32), datamodule=_data())
    messages = [str(w.message) for w in caught if issubclass(w.category, BigtrainWarning)]
    assert any("broke the compiled graph" in m and "Data-dependent branching" in m for m in messages), messages


def test_chunked_lm_head_loss_trains_like_the_plain_loss_and_is_switched_back():
    runs = {}
    for name, fused_loss in (("plain", False), ("chunked", True)):
        L.seed_everything(0, verbose=False)
        model, losses = _model(), _Losses()
        fusion = OperatorFusion("off", fused_optimizer=False, fused_loss=fused_loss)
        trainer = L.Trainer(devices=1, max_steps=6, callbacks=[fusion, losses], **_COMMON)
        trainer.fit(model, datamodule=_data())
        assert losses.chunked == [fused_loss] * 6  # the chunked loss computed every step when switched on
        assert fusion.fused_loss_active is False and model.fused_lm_head_loss is False  # put back at teardown
        runs[name] = losses.losses
    # The same loss, summed in another order (per chunk): float32 rounding only.
    torch.testing.assert_close(torch.tensor(runs["chunked"]), torch.tensor(runs["plain"]), rtol=1e-5, atol=0)
    # "auto" leaves a 65-character vocabulary alone: chunking pays from 8,192 classes up.
    auto = OperatorFusion("off", fused_optimizer=False)
    trainer = L.Trainer(devices=1, max_steps=1, callbacks=[auto], **_COMMON)
    trainer.fit(_model(), datamodule=_data())
    assert auto.fused_loss_active is False


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"OperatorFusion\(compile='max'\)`: choose one of auto, regional, full, off"):
        OperatorFusion("max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"warmup_steps=0, trial_steps=5\)`: both must be >= 1"):
        OperatorFusion(warmup_steps=0)
    with pytest.raises(ValueError, match=r"fused_loss='yes'"):
        OperatorFusion(fused_loss="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_gain=1.5"):
        OperatorFusion(min_gain=1.5)
