"""Resuming a checkpoint under another strategy than the one that wrote it, on 2 CPU ranks: a plain Lightning DDP
file into ZeRO at any stage, ZeRO-1/2's flat buckets into stage 3 and back. The resumed run ends on the weights of
the uninterrupted DDP run (the checkpoint at an epoch boundary, so that plain DDP's data order resumes too); what
cannot be converted (DeepSpeed's folders and the torch engine's, both ways) is refused with the way out."""

from __future__ import annotations

import glob
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from tests.helpers.distributed import run_on_ranks
from tests.helpers.strategies import strategy

pytestmark = pytest.mark.integration

_COMMON = dict(accelerator="cpu", devices=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
               enable_model_summary=False)  # fmt: skip
_STEPS, _STOP = 24, 16  # 16 optimizer steps per epoch: the checkpoint is at the end of the first


class _StopAt(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= _STOP:
            trainer.should_stop = True


def _fit(name: str, folder: str | None = None, ckpt_path: str | None = None) -> torch.Tensor:
    """The char-GPT with its warm-up + cosine schedule over 24 steps (stopped after 16 when it saves)."""
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=3)
    callbacks = [ModelCheckpoint(dirpath=folder, every_n_train_steps=_STOP), _StopAt()] if folder else []
    trainer = L.Trainer(strategy=strategy(name), max_steps=_STEPS, enable_checkpointing=bool(folder),
                        callbacks=callbacks, **_COMMON)  # fmt: skip
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=256), ckpt_path=ckpt_path)

    def full(t):
        f = getattr(t, "full_tensor", None)
        return (f() if callable(f) else t).detach().reshape(-1).cpu()

    return torch.cat([full(p) for p in model.parameters()])


def _switch(rank: int, root: str, pairs: list[tuple[str, str]]) -> dict[str, object]:
    out: dict[str, object] = {"ddp": _fit("ddp")}
    for saved, resumed in pairs:
        folder = os.path.join(root, f"{saved}_{resumed}")
        _fit(saved, folder=folder)
        (checkpoint,) = glob.glob(os.path.join(folder, "*.ckpt"))
        try:
            out[f"{saved}>{resumed}"] = _fit(resumed, ckpt_path=checkpoint)
        except ValueError as err:
            out[f"{saved}>{resumed}"] = str(err)
    return out


def test_resume_under_another_strategy_ends_where_ddp_ends(tmp_path):
    """Before: a DDP file into ZeRO-1/2 failed deep in torch's checkpoint reader, into ZeRO-3 on Lightning's re-keying
    by module order (the char-GPT's optimizer groups its parameters otherwise); ZeRO-1's folder into ZeRO-3 and back
    on missing keys."""
    pairs = [("ddp", "zero1"), ("ddp", "zero3"), ("zero1", "zero3"), ("zero3", "zero2")]
    for r in run_on_ranks(_switch, str(tmp_path), pairs, init_process_group=False):
        for saved, resumed in pairs:
            torch.testing.assert_close(r[f"{saved}>{resumed}"], r["ddp"], rtol=0, atol=1e-6, msg=f"{saved}>{resumed}")


def test_deepspeed_and_torch_engine_checkpoints_refuse_each_other(tmp_path):
    pairs = [("ddp", "ds2"), ("ds2", "zero2")]
    r = run_on_ranks(_switch, str(tmp_path), pairs, init_process_group=False)[0]
    assert "is not DeepSpeed's checkpoint (one file: plain Lightning's)" in r["ddp>ds2"]
    assert "Resume it with ZeroStrategy" in r["ddp>ds2"]
    assert "it is DeepSpeed's checkpoint" in r["ds2>zero2"]
    assert "bigtrain consolidate" in r["ds2>zero2"]


def _consolidated(rank: int, root: str, saved: str) -> dict[str, object]:
    from lightning_bigtrain.strategies.zero import consolidate_checkpoint

    folder = os.path.join(root, saved)
    _fit(saved, folder=folder)
    (checkpoint,) = glob.glob(os.path.join(folder, "*.ckpt"))
    single = os.path.join(root, f"{saved}.ckpt")
    if rank == 0:
        consolidate_checkpoint(checkpoint, single)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    keys = sorted(torch.load(single, weights_only=False)["optimizer_states"][0]["state"])
    return {"ddp": _fit("ddp"), "resumed": _fit("ddp", ckpt_path=single), "keys": keys}


@pytest.mark.parametrize("saved", ["zero1", "zero3"])
def test_consolidated_file_resumes_in_plain_lightning_ddp(tmp_path, saved):
    """The consolidated file holds the optimizer states as a plain optimizer keys them (by position over its groups),
    so plain Lightning's DDP resumes the ZeRO run's training exactly; before, it held the weights only."""
    results = run_on_ranks(_consolidated, str(tmp_path), saved, init_process_group=False)
    for r in results:
        assert r["keys"] == list(range(len(r["keys"]))) and len(r["keys"]) > 10
        torch.testing.assert_close(r["resumed"], r["ddp"], rtol=0, atol=1e-6)


def _averaged_switch(rank: int, root: str, pairs: list[tuple[str, str]]) -> dict[str, object]:
    """Lightning's ``EMAWeightAveraging``: stopped mid-epoch (step 6 of the 24-step schedule) and saved under one
    layout, resumed under another, against the uninterrupted run (ZeRO's data cursor resumes exactly, and stages 1
    and 3 train alike)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    class StopAt6(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.should_stop or trainer.global_step >= 6

    def fit(name: str, callbacks: list, ckpt_path: str | None = None) -> torch.Tensor:
        L.seed_everything(0, verbose=False)
        model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=3)
        averaging = EMAWeightAveraging(decay=0.9)
        trainer = L.Trainer(strategy=strategy(name), max_steps=_STEPS, callbacks=[averaging, *callbacks],
                            enable_checkpointing=bool(callbacks), **_COMMON)  # fmt: skip
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=256),
                    ckpt_path=ckpt_path)  # fmt: skip
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                          for p in model.parameters()])  # fmt: skip

    out: dict[str, object] = {"whole": fit("zero1", [])}
    for first, second in pairs:
        folder = os.path.join(root, f"{first}-{second}")
        fit(first, [ModelCheckpoint(dirpath=folder, every_n_train_steps=6), StopAt6()])
        (saved,) = glob.glob(os.path.join(folder, "*.ckpt"))
        out[f"{first}>{second}"] = fit(second, [], ckpt_path=saved)
    return out


def test_a_weight_averaging_checkpoint_resumes_in_another_layout(tmp_path):
    """Failed on a KeyError for `state_dict` in the callback (the conversion took it out of the checkpoint), and
    stage 3's sharded parameters could not take the whole `current_model_state`."""
    pairs = [("zero1", "zero3"), ("zero3", "zero1")]
    for r in run_on_ranks(_averaged_switch, str(tmp_path), pairs, init_process_group=False):
        for first, second in pairs:
            torch.testing.assert_close(r[f"{first}>{second}"], r["whole"], rtol=0, atol=1e-6)
