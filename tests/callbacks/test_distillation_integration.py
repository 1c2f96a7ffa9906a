"""KnowledgeDistillation in real fits: parity, the logit cache across epochs and runs, teachers from
checkpoints and under ZeRO-3, checkpoints that load without the callback, and bad input."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.callbacks import DistillationOptions, KnowledgeDistillation
from lightning_bigtrain.data import FashionMNISTDataModule
from lightning_bigtrain.models import FashionCNN
from lightning_bigtrain.strategies import ZeroStrategy
from lightning_bigtrain.warnings import BigtrainWarning
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def _teacher(**kwargs: Any) -> FashionCNN:
    with torch.random.fork_rng():
        torch.manual_seed(99)
        return FashionCNN(channels=(16, 32), **kwargs)


def _data(subset: int = 64) -> FashionMNISTDataModule:
    return FashionMNISTDataModule(batch_size=16, subset=subset)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fit(callbacks: list[L.Callback], devices: int = 2, max_steps: int = 4, **kwargs: Any) -> tuple[L.Trainer, Any]:
    L.seed_everything(0, verbose=False)
    model = FashionCNN(channels=(8, 16))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=max_steps, limit_val_batches=0,
                        callbacks=callbacks, **{**_QUIET, **kwargs})  # fmt: skip
    trainer.fit(model, datamodule=_data())
    return trainer, model


def _parity(rank: int) -> dict[str, Any]:
    _, plain = _fit([])
    kd = KnowledgeDistillation(_teacher(), alpha=0.0)
    trainer, distilled = _fit([kd])
    _, full = _fit([KnowledgeDistillation(_teacher(), alpha=1.0, temperature=4.0)])
    return {
        "plain": _params(plain),
        "alpha0": _params(distilled),
        "alpha1": _params(full),
        "logged": sorted(k for k in trainer.callback_metrics if k.startswith("distill/")),
        "restored": "training_step" not in vars(distilled) and not hasattr(distilled, "kd_projections"),
        "teacher_frozen": kd.teacher is None,
    }


def test_alpha_zero_trains_exactly_as_without_distillation_and_the_module_is_restored():
    for r in run_on_ranks(_parity, init_process_group=False):
        assert torch.equal(r["alpha0"], r["plain"])  # the task loss alone, bit for bit
        assert not torch.equal(r["alpha1"], r["plain"])  # the teacher's signal alone moves the weights elsewhere
        assert r["logged"] == ["distill/agreement", "distill/alpha", "distill/kd_loss", "distill/task_loss"]
        assert r["restored"] and r["teacher_frozen"]


class _NoisyCNN(FashionCNN):
    """Random augmentation inside training_step: the student (and teacher) never see the same input twice."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x + 0.1 * torch.randn_like(x)), y)


def _cache_runs(rank: int, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Run 1: 2 epochs of 2 steps per rank; the first fills the cache, the second hits (ranks' entries merged).
    kd = KnowledgeDistillation(_teacher(), cache=url, options=DistillationOptions(cache_top_k=4))
    _fit([kd], max_steps=-1, max_epochs=2)
    out["run1"] = (kd._hits, kd._misses)
    # Run 2: a new callback reads the file: every batch hits from the first step, and the loss is the same as
    # from the live teacher truncated to the same top-k.
    kd2 = KnowledgeDistillation(_teacher(), cache=url, options=DistillationOptions(cache_top_k=4))
    _, cached = _fit([kd2], max_steps=-1, max_epochs=1)
    out["run2"] = (kd2._hits, kd2._misses)
    fresh = f"{url}.fresh"
    kd3 = KnowledgeDistillation(_teacher(), cache=fresh, options=DistillationOptions(cache_top_k=4))
    _, live = _fit([kd3], max_steps=-1, max_epochs=1)
    out["cached_vs_live"] = (_params(cached) - _params(live)).abs().max().item()
    # Augmented inputs are not in the cache: the live teacher answers, with a warning.
    kd4 = KnowledgeDistillation(_teacher(), cache=url, options=DistillationOptions(cache_top_k=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, limit_val_batches=0, callbacks=[kd4], **_QUIET)
        trainer.fit(_NoisyCNN(channels=(8, 16)), datamodule=_data())
    out["noisy"] = (kd4._hits, kd4._misses)
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, BigtrainWarning)]
    return out


def test_cache_is_filled_once_reused_across_epochs_and_runs_and_detects_unseen_inputs(tmp_path):
    url = str(tmp_path / "cache" / "teacher.pt")
    results = run_on_ranks(_cache_runs, url, init_process_group=False)
    for r in results:
        assert r["run1"] == (2, 2)
        assert r["run2"] == (2, 0)
        assert r["cached_vs_live"] == 0.0  # a hit returns exactly what the live teacher's top-k gave
        assert r["noisy"] == (0, 2)
    assert any("inputs the cache has not seen" in m for m in results[0]["warned"])
    # Another teacher may not use this file.
    kd = KnowledgeDistillation(_teacher(num_classes=10, lr=0.5), cache=url)
    kd.teacher_source = FashionCNN(channels=(4, 8))
    with pytest.raises(ValueError, match=r"was written for another teacher, top-k or temperature"):
        _fit([kd], devices=1)


def test_teacher_from_a_checkpoint_and_the_students_checkpoint_loads_without_the_callback(tmp_path):
    teacher_path = tmp_path / "teacher.ckpt"
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, **_QUIET)
    trainer.fit(_teacher(), datamodule=_data())
    trainer.save_checkpoint(teacher_path)
    kd = KnowledgeDistillation(teacher_path, features={"features.5": "features.5"})
    captured: dict[str, Any] = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            captured["teacher_channels"] = kd.teacher.hparams["channels"]
            captured["projection"] = type(pl_module.kd_projections["hint0"]).__name__

    saver = ModelCheckpoint(dirpath=tmp_path, filename="student", save_last=False)
    trainer, student = _fit([kd, Peek(), saver], devices=1, max_steps=2, enable_checkpointing=True)
    assert captured == {"teacher_channels": (16, 32), "projection": "Conv2d"}
    assert "distill/feature_loss" in trainer.callback_metrics
    path = tmp_path / "student.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["bigtrain_distillation"]["projections"]) == {"kd_projections.hint0.weight"}
    reloaded = FashionCNN.load_from_checkpoint(path)  # strict: no projection keys in its state_dict
    torch.testing.assert_close(_params(reloaded), _params(student))


def _zero3_teacher(rank: int) -> dict[str, Any]:
    kd = KnowledgeDistillation(_teacher())
    seen: dict[str, Any] = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["sharded"] = all(type(p).__name__ == "DTensor" for p in kd.teacher.parameters())
            seen["local"] = sum(p.to_local().numel() for p in kd.teacher.parameters())
            seen["full"] = sum(p.numel() for p in kd.teacher.parameters())

    trainer, _ = _fit([kd, Peek()], strategy=ZeroStrategy(stage=3, min_wrap_params=100), max_steps=3)
    seen["kd_loss"] = float(trainer.callback_metrics["distill/kd_loss"])
    return seen


def test_teacher_is_sharded_with_the_student_under_zero3():
    for r in run_on_ranks(_zero3_teacher, init_process_group=False):
        assert r["sharded"] and r["local"] <= r["full"] / 2 + 64
        assert r["kd_loss"] > 0


def _zero3_submodule_teacher(rank: int) -> float:
    from benchmarks.conformance import _data, _hf_gpt2

    L.seed_everything(0, verbose=False)
    kd = KnowledgeDistillation(_hf_gpt2())
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, limit_val_batches=0, callbacks=[kd],
                        strategy=ZeroStrategy(stage=3, min_wrap_params=10_000), **_QUIET)  # fmt: skip
    trainer.fit(_hf_gpt2(), datamodule=_data("text"))
    return float(trainer.callback_metrics["distill/kd_loss"])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_sharded_teacher_called_through_its_submodule_gathers_its_root():
    """A Hugging Face student's step calls ``self.model(...)``, so the teacher's same-named submodule is called
    directly: under ZeRO-3 the teacher's root unit (GPT-2's tied embedding, its final norm) was never gathered
    ("aten.embedding got mixed torch.Tensor and DTensor"). Every Hugging Face family failed so."""
    for kd_loss in run_on_ranks(_zero3_submodule_teacher, init_process_group=False):
        assert kd_loss > 0


def test_bad_teachers_and_layer_names_are_named():
    with pytest.raises(ValueError, match=r"the teacher's output has shape \(16, 5\), the student's \(16, 10\)"):
        _fit([KnowledgeDistillation(_teacher(num_classes=5))], devices=1)
    with pytest.raises(ValueError, match=r"the student has no layer named 'features.50'. Available: features, "):
        _fit([KnowledgeDistillation(_teacher(), features={"features.50": "features.5"})], devices=1)
    with pytest.raises(ValueError, match=r"cannot tell the output width of layer 'features.2' \(ReLU\)"):
        _fit([KnowledgeDistillation(_teacher(), features={"features.2": "features.5"})], devices=1)


def _s3_cache(rank: int, url: str) -> list[tuple[int, int]]:
    out = []
    for _ in range(2):  # the first run fills and writes the cache; the second reads it back
        kd = KnowledgeDistillation(_teacher(), cache=url, options=DistillationOptions(cache_top_k=4))
        _fit([kd], max_steps=-1, max_epochs=1)
        out.append((kd._hits, kd._misses))
    return out


def test_cache_on_an_s3_compatible_server(s3_bucket):
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/kd/teacher.pt"
    for runs in run_on_ranks(_s3_cache, url, init_process_group=False):
        assert runs == [(0, 2), (2, 0)]  # filled and written; then read back: all hits
    assert fs.exists(f"{bucket}/kd/teacher.pt")


class _SubmoduleStep(L.LightningModule):
    """A step that calls a submodule (`self.net(...)` with keyword arguments, as Hugging Face users write), never
    the LightningModule's own forward."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from lightning_bigtrain.models import CharGPT

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(idx=x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _OneInput(_SubmoduleStep):
    """A student whose forward takes one tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _text() -> L.LightningDataModule:
    from lightning_bigtrain.data import ShakespeareDataModule

    return ShakespeareDataModule(block_size=16, batch_size=4, subset=32)


def test_a_step_that_calls_a_submodule_is_distilled_through_the_teachers_same_submodule():
    kd = KnowledgeDistillation(_SubmoduleStep(seed=7), alpha=1.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, callbacks=[kd], **_QUIET)
    student = _SubmoduleStep(seed=0)
    trainer.fit(student, datamodule=_text())
    assert torch.isfinite(trainer.callback_metrics["distill/kd_loss"])
    # alpha=1: the loss is the distillation loss alone, so the step's output is the KD loss, not the task loss.
    assert trainer.callback_metrics["distill/kd_loss"] != trainer.callback_metrics["distill/task_loss"]


def test_a_teacher_whose_forward_takes_other_inputs_is_refused_with_what_to_do_and_teacher_call_works():
    from lightning.pytorch.demos.transformer import Transformer

    def teacher() -> Transformer:
        with torch.random.fork_rng():
            torch.manual_seed(3)
            return Transformer(vocab_size=96, ninp=32, nhead=2, nhid=32, nlayers=1, dropout=0.0)

    def fit(options: DistillationOptions) -> L.Trainer:
        kd = KnowledgeDistillation(teacher(), options=options)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, callbacks=[kd], **_QUIET)
        trainer.fit(_OneInput(seed=0), datamodule=_text())
        return trainer

    with pytest.raises(
        TypeError,
        match=r"teacher \(Transformer.forward\(inputs: torch.Tensor, target.*DistillationOptions\(teacher_call=",
    ):
        fit(DistillationOptions())
    # The demo's forward takes (inputs, target) and returns log-probabilities flattened to (B*T, V).
    trainer = fit(DistillationOptions(teacher_call=lambda t, x: t(x, x).view(*x.shape, -1)))
    assert torch.isfinite(trainer.callback_metrics["distill/kd_loss"])
