"""BF16Precision in real 2-rank fits: everything in bf16, compensation buffers sharded with the optimizer."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_bigtrain.callbacks import RunReport
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.functional.bf16 import COMPENSATION_KEY
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.plugins import BF16Precision
from lightning_bigtrain.strategies import ZeroStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def _fit(rank: int, strategy_name: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, warmup_steps=2)
    psi = sum(p.numel() for p in model.parameters())
    strategy = "ddp" if strategy_name == "ddp" else ZeroStrategy(stage=int(strategy_name[-1]), min_wrap_params=1000)
    report = RunReport(verbose=False, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[BF16Precision("kahan")],
                        max_steps=3, limit_val_batches=0, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[report])  # fmt: skip
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=64))
    optimizer = trainer.optimizers[0]
    states = list(optimizer.state.values())
    return {
        "params": {p.dtype for p in model.parameters()},
        "moments": {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")},
        "compensation": {s[COMPENSATION_KEY].dtype for s in states},
        "compensation_numel": sum(_local_numel(s[COMPENSATION_KEY]) for s in states),
        "psi": psi,
        "bytes_per_param": report.report["model_state_bytes_per_rank"][rank] / psi if rank == 0 else None,
    }


@pytest.mark.parametrize(("strategy", "bytes_per_param"), [("ddp", 10.0), ("zero2", 6.0), ("zero3", 5.0)])
def test_everything_is_bf16_and_the_kahan_buffers_are_sharded_with_the_optimizer(strategy, bytes_per_param):
    """AdamW with Kahan: bf16 weights 2 + gradients 2 + two moments 4 + buffer 2 = 10 bytes per parameter;
    ZeRO-2 on 2 ranks shards all but the weights (2 + 8/2 = 6), ZeRO-3 everything (10/2 = 5)."""
    results = run_on_ranks(_fit, strategy, init_process_group=False)
    for r in results:
        assert r["params"] == r["moments"] == r["compensation"] == {torch.bfloat16}
        sharded = strategy != "ddp"
        assert r["compensation_numel"] == (r["psi"] // 2 if sharded else r["psi"])
    assert results[0]["bytes_per_param"] == pytest.approx(bytes_per_param, rel=0.02)


class _EMAOfTheModule(L.Callback):
    """The EMA ``EMAWeightAveraging(decay)`` should hold of this bf16 module, kept by hand (whole) after each step."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.average: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        now = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float() for p in pl_module.parameters()]
        if not self.average:
            self.average = [t.clone() for t in now]
        for a, t in zip(self.average, now, strict=True):
            a.lerp_(t, 1 - self.decay)


def _averaged(rank: int, strategy_name: str) -> dict:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, warmup_steps=2)
    strategy = "ddp" if strategy_name == "ddp" else ZeroStrategy(stage=int(strategy_name[-1]), min_wrap_params=1000)
    averaging, reference = EMAWeightAveraging(decay=0.5), _EMAOfTheModule(0.5)
    data = ShakespeareDataModule(block_size=32, batch_size=8, subset=64)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[BF16Precision("kahan")],
                        max_steps=4, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[averaging, reference])  # fmt: skip
    trainer.fit(model, datamodule=data)
    average = [(a.full_tensor() if hasattr(a, "full_tensor") else a).detach()
               for a in averaging._average_model.module.parameters()]  # fmt: skip
    exact = sum(int((a == a.to(torch.bfloat16).float()).sum()) for a in average)
    return {
        "dtypes": {a.dtype for a in average},
        "bf16_share": exact / sum(a.numel() for a in average),
        "gap": max((a - r).abs().max().item() for a, r in zip(average, reference.average, strict=True)),
    }


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_weight_averaging_keeps_its_fp32_average_of_the_bf16_module(strategy):
    """Lightning's EMA of a BF16Precision module: its swap into the module around each validation rounded the whole
    fp32 average to bf16 (1.0 of its values after 4 validations; an EMA then stops taking increments below half a
    bf16 step), and at stage 3 the average was made bf16 when it was sharded like the module. Now it stays the
    fp32 EMA of the module's weights."""
    for r in run_on_ranks(_averaged, strategy, init_process_group=False):
        assert r["dtypes"] == {torch.float32}
        assert r["bf16_share"] < 0.3, r["bf16_share"]  # 0.12 (DDP), 0.06 (stage 3)
        assert r["gap"] <= 1e-6, r["gap"]


def _averaged_resumes(rank: int, folder: str, pairs: list[tuple[int, int]]) -> dict:
    """EMAWeightAveraging of a BF16Precision module, saved at step 2 under one ZeRO stage and resumed under another:
    what the resumed run starts from against what was saved."""
    import os

    from lightning.pytorch.callbacks import EMAWeightAveraging

    from tests.strategies.test_full_state_dict_integration import _HeldAtStart, _SaveAt

    def fit(stage: int, callbacks: list, ckpt_path: str | None = None) -> None:
        L.seed_everything(0, verbose=False)
        model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, warmup_steps=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, min_wrap_params=1000),
                            plugins=[BF16Precision("kahan")], max_steps=3, limit_val_batches=0,
                            enable_checkpointing=False, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=callbacks)  # fmt: skip
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=64),
                    ckpt_path=ckpt_path)  # fmt: skip

    out = {}
    for first, second in pairs:
        name = f"{first}-{second}"
        averaging = EMAWeightAveraging(decay=0.5)
        saved = _HeldAtStart(averaging)
        fit(first, [averaging, _SaveAt(2, folder, name), saved])
        averaging = EMAWeightAveraging(decay=0.5)
        start = _HeldAtStart(averaging)
        fit(second, [averaging, start], ckpt_path=os.path.join(folder, name))
        out[name] = [max((a - b).abs().max().item() for a, b in zip(x, y, strict=True))
                     for x, y in ((saved.weights, start.weights), (saved.average, start.average))]  # fmt: skip
    return out


def test_weight_averaging_of_a_bf16_module_resumes_its_fp32_average(tmp_path):
    """Resumed at stage 3 (from stage 3, or converted from stage 1), the fp32 average was read through the bf16
    module it had been loaded into (rounded: 3.9e-3 off what was saved). Now the resumed run starts from it exactly."""
    for r in run_on_ranks(_averaged_resumes, str(tmp_path), [(3, 3), (1, 3)], init_process_group=False):
        assert r == {"3-3": [0.0, 0.0], "1-3": [0.0, 0.0]}, r
