"""RunReport: a real fit writes a complete report; bad arguments are rejected."""

from __future__ import annotations

import json

import lightning as L
import pytest

from lightning_bigtrain.callbacks import RunReport, format_report
from lightning_bigtrain.models import CharGPT


def test_report_of_a_real_fit(tmp_path, shakespeare_subset, capsys):
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=1, n_head=2, n_embd=32)
    report = RunReport(path=str(tmp_path / "r" / "report.md"), title="t", warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, limit_val_batches=2, num_sanity_val_steps=0,
                        val_check_interval=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[report])  # fmt: skip
    trainer.validate(model, datamodule=shakespeare_subset, verbose=False)
    trainer.fit(model, datamodule=shakespeare_subset)
    r = report.report
    assert r["steps"] == 8 and r["timed_steps"] == 6 and r["world_size"] == 1
    assert r["strategy"] == "SingleDeviceStrategy" and "RunReport" in r["callbacks"]
    assert r["val_loss_start"] > r["val_loss_end"]
    assert r["train_loss_start"] > r["train_loss_end"]
    # 6 timed batches of 16 sequences x 32 characters.
    assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)
    assert r["samples_per_s"] * r["seconds"] == pytest.approx(6 * 16)
    assert len(r["peak_memory_bytes_per_rank"]) == 1 and r["peak_memory_bytes_per_rank"][0] > 0
    assert r["model_state_bytes_per_rank"][0] > 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert text == format_report(r) and "tokens/s" in text and text in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "report.json").read_text())["steps"] == 8


def test_float_inputs_report_samples_not_tokens(fashion_subset):
    from lightning_bigtrain.models import FashionCNN

    report = RunReport(verbose=False, warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, callbacks=[report])  # fmt: skip
    trainer.fit(FashionCNN(channels=(4,)), datamodule=fashion_subset)
    assert report.report["tokens_per_s"] is None and report.report["samples_per_s"] > 0
    assert report.report["val_loss_start"] is None and report.report["val_loss_end"] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"warmup_steps": -1}, r"warmup_steps=-1"), ({"warmup_steps": 1.5}, r"warmup_steps=1.5"),
     ({"path": "report.txt"}, r"ending in `\.md`")],
)  # fmt: skip
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunReport(**kwargs)


def test_one_step_run_still_counts_model_states(fashion_subset):
    from lightning_bigtrain.models import FashionCNN

    report = RunReport(verbose=False, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, callbacks=[report])  # fmt: skip
    trainer.fit(FashionCNN(channels=(4,)), datamodule=fashion_subset)
    assert report.report["model_state_bytes_per_rank"][0] > 0
