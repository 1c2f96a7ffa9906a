"""``compression="auto"``: timed trials of each candidate, one choice on every rank, logged and checkpointed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_bigtrain.compression import AutoCompression, OneBitAdam, PowerSGD, TopK
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import CompressedDDPStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.strategies.test_zero_integration import _MetricsLogger

# -- construction --


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"candidates": ("powersgd",)}, ValueError, "the dense option and at least one compressor"),
        ({"candidates": "powersgd"}, ValueError, "the dense option and at least one compressor"),
        ({"candidates": ("powersgd", "fp16")}, ValueError, "Put 'fp16' or 'bf16' .a Cast. first"),
        ({"candidates": ("fp16", "zip")}, ValueError, "candidate 1 is 'zip'"),
        ({"candidates": ("fp16", 3)}, TypeError, "candidate 1 is 3"),
        ({"candidates": ("fp16", PowerSGD(warmup_steps=5))}, ValueError, "has warmup_steps=5"),
        ({"trial_steps": 1}, ValueError, r"trial_steps=1.*int >= 2"),
        ({"margin": 1.0}, ValueError, r"margin=1.0.*\[0, 1\)"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        AutoCompression(**kwargs)


def test_auto_runs_under_compressed_ddp_only():
    assert isinstance(CompressedDDPStrategy("auto").compression, AutoCompression)
    for bad in ("auto", AutoCompression()):
        with pytest.raises(ValueError, match=re.escape("runs under CompressedDDPStrategy only")):
            ZeroStrategy(stage=2, compression=bad)
    with pytest.raises(ValueError, match="'auto' picks a gradient exchange"):
        OneBitAdam(compressor=AutoCompression())
    with pytest.raises(ValueError, match="'auto'"):  # the list of names offers it
        CompressedDDPStrategy("zip")


# -- the decision, fed step times (one process: a real world-1 gloo group) --


def _decide(rank: int, margin: float, seconds: tuple[float, ...]) -> dict[str, Any]:
    from lightning_bigtrain.engines.compression import GradientCompression

    model = torch.nn.Linear(64, 64)
    auto = AutoCompression(("fp16", TopK(0.1), "powersgd"), trial_steps=3, margin=margin)
    engine = GradientCompression(auto, model)
    actives, decided = [], []
    for candidate in range(3):
        for _ in range(3):
            actives.append(type(auto.active).__name__)
            engine.errors["weight"] = torch.ones(64, 64)  # what a compressed step would carry
            engine.advance()
            decided.append(auto.record(seconds[candidate], engine, torch.device("cpu")))
    state = auto.state_dict()
    again = AutoCompression(("fp16", TopK(0.1), "powersgd"), trial_steps=3, margin=margin)
    again.load_state_dict(state)
    chosen = auto.chosen
    GradientCompression(auto, model)  # the same object in a new run: its trials start again
    fresh = auto.chosen is None and auto.step == 0 and auto.times == [[], [], []]
    auto.load_state_dict(state)
    assert auto.chosen == chosen
    return {"fresh": fresh, "actives": actives, "decided": decided, "chosen": auto.chosen, "seconds": auto.step_seconds,
            "errors_kept": bool(engine.errors), "summary": auto.summary(), "restored": type(again.active).__name__,
            "times": auto.times}  # fmt: skip


def test_the_fastest_compressor_is_chosen_only_when_it_beats_dense_by_the_margin():
    r = run_on_ranks(_decide, 0.1, (1.0, 0.5, 0.8), world_size=1)[0]
    assert r["actives"] == ["Cast"] * 3 + ["TopK"] * 3 + ["PowerSGD"] * 3  # each candidate for trial_steps steps
    assert r["decided"] == [False] * 8 + [True]  # decided once, after the last trial step
    assert r["times"] == [[1.0, 1.0], [0.5, 0.5], [0.8, 0.8]]  # the first step of each trial is not timed
    assert r["chosen"] == 1 and r["seconds"] == [1.0, 0.5, 0.8] and r["restored"] == "TopK" and r["fresh"]
    assert "chose TopK(" in r["summary"]
    # A compressor 5% faster than dense does not clear a 10% margin: dense, and the trial's residual is dropped.
    r = run_on_ranks(_decide, 0.1, (1.0, 0.95, 0.97), world_size=1)[0]
    assert r["chosen"] == 0 and r["restored"] == "Cast" and not r["errors_kept"]
    r = run_on_ranks(_decide, 0.0, (1.0, 0.95, 0.97), world_size=1)[0]
    assert r["chosen"] == 1


# -- through the strategy, 2 ranks --


class _StopAt(L.Callback):
    """Stops the run after ``step`` optimizer steps, as a pre-empted job would (the run still plans its full
    ``max_steps``: CharGPT's learning-rate schedule is laid out over them)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


class _CompressedWins(AutoCompression):
    """Its dense trial timed 10x slower than it ran: the compressed choice whatever this host's timings (a run that
    must end the same way twice cannot depend on them)."""

    def record(self, seconds: float, engine: Any, device: torch.device) -> bool:
        return super().record(seconds * 10 if self.active is self.candidates[0] else seconds, engine, device)


def _fit(
    rank: int, root: str, margin: float, stop_at: int | None, resume: str | None, compressed: bool = False
) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    logger = _MetricsLogger()
    auto = (_CompressedWins if compressed else AutoCompression)(("fp16", "powersgd"), trial_steps=3, margin=margin)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(auto), max_steps=10,
                        limit_val_batches=0, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoint, _StopAt(stop_at)],
                        default_root_dir=root)  # fmt: skip
    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=32, warmup_steps=2)
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=16, batch_size=4, subset=256), ckpt_path=resume)
    engine = trainer.strategy.compression_engine
    assert engine is not None
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "chosen": auto.chosen,
        "seconds": auto.step_seconds,
        "steps": auto.step,
        "sent": engine.sent_bytes,
        "dense": engine.dense_bytes,
        "logged": [m for m in logger.metrics if "compression/auto_choice" in m],
    }


def test_every_rank_takes_the_same_choice_logs_it_and_a_resumed_run_keeps_it(tmp_path: Path):
    # margin 0.99: PowerSGD would have to be 100x faster, so the choice is dense and the run reproducible.
    full = run_on_ranks(_fit, str(tmp_path / "a"), 0.99, None, None, init_process_group=False)
    for r in full:
        assert r["chosen"] == 0 and r["steps"] == 10 and len(r["seconds"]) == 2
    assert full[0]["seconds"] == full[1]["seconds"]  # the ranks' medians were agreed
    assert torch.equal(full[0]["params"], full[1]["params"])
    assert full[0]["logged"] == [{"compression/auto_choice": 0.0, "compression/auto_step_s_0": full[0]["seconds"][0],
                                  "compression/auto_step_s_1": full[0]["seconds"][1]}]  # fmt: skip
    # PowerSGD ran its trial (3 steps), then fp16: fewer bytes than six fp16 steps plus four fp16 ones would be.
    assert full[0]["dense"] / full[0]["sent"] > 2.0
    # Stopped at step 8 (after the choice, checkpoint at step 8) and resumed: the choice comes from the checkpoint,
    # no new trials, and the run ends bit-identical to the uninterrupted one.
    run_on_ranks(_fit, str(tmp_path / "b"), 0.99, 8, None, init_process_group=False)
    ckpt = str(tmp_path / "b" / "epoch=0-step=8.ckpt")
    resumed = run_on_ranks(_fit, str(tmp_path / "b"), 0.99, None, ckpt, init_process_group=False)
    for r in resumed:
        assert r["chosen"] == 0 and r["logged"] == []
        assert torch.equal(r["params"], full[0]["params"])
    # Stopped at step 4 (in PowerSGD's trial) and resumed: the trials go on from there and decide at step 6.
    run_on_ranks(_fit, str(tmp_path / "c"), 0.99, 4, None, init_process_group=False)
    ckpt = str(tmp_path / "c" / "epoch=0-step=4.ckpt")
    resumed = run_on_ranks(_fit, str(tmp_path / "c"), 0.99, None, ckpt, init_process_group=False)
    assert [len(r["logged"]) for r in resumed] == [1, 0], resumed  # rank 0 logs
    for r in resumed:
        assert r["chosen"] == 0
        assert torch.equal(r["params"], full[0]["params"])


def test_a_run_resumed_after_a_compressed_choice_keeps_it_and_its_error_feedback(tmp_path: Path):
    """The choice PowerSGD: stopped at step 8 (after the choice), resumed from that checkpoint, the run keeps
    PowerSGD without new trials and ends bit-identical to the uninterrupted one -- which needs each rank's error
    buffers and PowerSGD's warm-start factors back from the checkpoint."""
    full = run_on_ranks(_fit, str(tmp_path / "a"), 0.1, None, None, True, init_process_group=False)
    for r in full:
        assert r["chosen"] == 1 and r["steps"] == 10
        assert r["dense"] / r["sent"] > 3  # PowerSGD from step 4 on: fewer bytes than fp16 alone (2x)
    assert torch.equal(full[0]["params"], full[1]["params"])
    run_on_ranks(_fit, str(tmp_path / "b"), 0.1, 8, None, True, init_process_group=False)
    ckpt = str(tmp_path / "b" / "epoch=0-step=8.ckpt")
    resumed = run_on_ranks(_fit, str(tmp_path / "b"), 0.1, None, ckpt, True, init_process_group=False)
    for r in resumed:
        assert r["chosen"] == 1 and r["logged"] == []
        assert torch.equal(r["params"], full[0]["params"])


def _family(rank: int, family: str, margin: float) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data

    L.seed_everything(0, verbose=False)
    model = _build(FAMILIES[family], 0)
    auto = AutoCompression(("fp16", "powersgd"), trial_steps=2, margin=margin)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(auto), max_steps=6,
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, datamodule=_data(FAMILIES[family].data))
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "chosen": auto.chosen,
            "seconds": auto.step_seconds, "loss": float(trainer.callback_metrics["train_loss"])}  # fmt: skip


@pytest.mark.parametrize("family", ["hf_gpt2", "timm_vit"])
def test_models_we_did_not_write_take_one_choice_on_every_rank(family):
    """`compression="auto"` on a Hugging Face GPT-2 and a timm ViT built from configs: both candidates timed, one
    choice agreed by the ranks (dense with a margin no compressor can beat; with no margin, the faster of the two on
    this host, the same on both ranks), identical replicas, a finite loss."""
    pytest.importorskip({"hf_gpt2": "transformers", "timm_vit": "timm"}[family])
    for margin in (0.99, 0.0):
        runs = run_on_ranks(_family, family, margin, init_process_group=False)
        assert runs[0]["chosen"] == runs[1]["chosen"] and runs[0]["chosen"] in (0, 1), runs
        assert margin < 0.5 or runs[0]["chosen"] == 0
        assert runs[0]["seconds"] == runs[1]["seconds"] and len(runs[0]["seconds"]) == 2
        assert torch.equal(runs[0]["params"], runs[1]["params"]) and torch.isfinite(torch.tensor(runs[0]["loss"]))
