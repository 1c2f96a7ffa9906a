"""1-bit Adam through CompressedDDPStrategy(compression=OneBitAdam(...)): the warm-up is Adam, the compressed phase
keeps replicas identical and sends 1/32 of the bytes, resumes exactly, and bad input is refused at construction or
setup."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.compression import OneBit, OneBitAdam, TopK
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import CompressedDDPStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_QUIET = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip


class _Track(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sent: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.sent.append(float(getattr(trainer.strategy, "comm_bytes", None) or 0))


class _Sgd(CharGPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _model(kind: type[CharGPT] = CharGPT) -> CharGPT:
    return kind(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=5)


def _data() -> ShakespeareDataModule:
    return ShakespeareDataModule(block_size=32, batch_size=8, subset=512)


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(rank: int, what: str, steps: int, folder: str | None = None) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    if what == "ddp":
        strategy: Any = "ddp"
    elif what == "topk":
        strategy = CompressedDDPStrategy(OneBitAdam(warmup_steps=4, compressor=TopK(0.05)))
    elif what in ("refresh", "squares"):
        source = "squares" if what == "squares" else "gradients"
        strategy = CompressedDDPStrategy(OneBitAdam(warmup_steps=4, variance_refresh=3, refresh_from=source))
    else:
        warmup = steps if what == "warm_only" else 4
        strategy = CompressedDDPStrategy(OneBitAdam(warmup_steps=warmup, variance_refresh=None))  # the paper's
    track = _Track()
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[track], enable_checkpointing=False,
                        **_QUIET)  # fmt: skip
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=_data())
    weights = _weights(model)
    gathered = [torch.empty_like(weights) for _ in range(2)]
    torch.distributed.all_gather(gathered, weights)
    optimizer = trainer.optimizers[0]
    return {
        "losses": track.losses,
        "sent": track.sent,
        "weights": weights,
        "replicas_equal": torch.equal(gathered[0], gathered[1]),
        "optimizer": type(optimizer).__name__,
        "shares_groups": optimizer.param_groups[0]["lr"] == trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
        "dense_per_step": 2 * 0.5 * 4 * sum(p.numel() for p in model.parameters()),  # ring all-reduce at 2 ranks
        "scheduler_warned": [str(w.message) for w in caught if "learning rate scheduler" in str(w.message)],
    }


def test_the_warm_up_is_adamw_and_the_compressed_phase_sends_a_thirty_second():
    """Warm-up only: the same trajectory as DDP with AdamW (1e-6; our Adam rounds in another order). With a 4-step
    warm-up: replicas stay bit-identical, the steps after it send 1/32 of the fp32 bytes (plus the dense tensors'
    share: none here), the loss falls, and the LR scheduler acts on the replacement optimizer."""
    ddp = run_on_ranks(_run, "ddp", 12, init_process_group=False)[0]
    warm = run_on_ranks(_run, "warm_only", 12, init_process_group=False)[0]
    assert warm["optimizer"] == "CompressedMomentumAdam"
    assert torch.allclose(warm["weights"], ddp["weights"], atol=1e-6, rtol=0)
    assert warm["losses"] == pytest.approx(ddp["losses"], rel=1e-5)

    for r in run_on_ranks(_run, "onebit", 12, init_process_group=False):
        assert r["replicas_equal"] and r["shares_groups"]
        assert not r["scheduler_warned"]  # the scheduler re-bound to the replacement sees its steps
        per_step = [b - a for a, b in zip(r["sent"], r["sent"][1:], strict=False)]
        assert per_step[0] == pytest.approx(r["dense_per_step"])  # a warm-up step: dense
        compressed = per_step[4:]
        assert max(compressed) <= r["dense_per_step"] / 16, (compressed, r["dense_per_step"])
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.3  # it trains
        # Within a few percent of DDP's loss after the same 12 steps (the benchmark measures the real budget).
        assert r["losses"][-1] == pytest.approx(ddp["losses"][-1], rel=0.05)


def test_topk_as_the_momentum_compressor_keeps_replicas_identical():
    for r in run_on_ranks(_run, "topk", 8, init_process_group=False):
        assert r["replicas_equal"] and r["losses"][-1] < r["losses"][0]


def test_variance_refreshes_send_a_quarter_and_keep_replicas_identical():
    """Every third compressed step exchanges the gradients in 8 bits (about a quarter of fp32's bytes) and moves
    the variance; the others send the 1-bit momentum."""
    for r in run_on_ranks(_run, "refresh", 12, init_process_group=False):
        assert r["replicas_equal"]
        per_step = [b - a for a, b in zip(r["sent"], r["sent"][1:], strict=False)]  # steps 2..12
        dense = r["dense_per_step"]
        refreshes = [per_step[i] for i in (5, 8)]  # optimizer steps 7 and 10: the 3rd and 6th compressed steps
        assert all(dense / 4.2 < b < dense / 3.5 for b in refreshes), (refreshes, dense)
        others = [b for i, b in enumerate(per_step[3:], start=3) if i not in (5, 8)]
        assert max(others) <= dense / 16, (others, dense)
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.3


def test_refreshes_from_the_ranks_variances_send_the_momentum_and_a_quarter_and_keep_replicas_identical():
    """refresh_from='squares': every step each rank folds its own squared gradient into its running second moment;
    every third compressed step the ranks average those in 8 bits (about a quarter of fp32's bytes) on top of the
    1-bit momentum, which is exchanged on every compressed step."""
    for r in run_on_ranks(_run, "squares", 12, init_process_group=False):
        assert r["replicas_equal"]
        per_step = [b - a for a, b in zip(r["sent"], r["sent"][1:], strict=False)]  # steps 2..12
        dense = r["dense_per_step"]
        refreshes = [per_step[i] for i in (5, 8)]  # optimizer steps 7 and 10
        assert all(dense / 3.7 < b < dense / 3.2 for b in refreshes), (refreshes, dense)
        others = [b for i, b in enumerate(per_step[3:], start=3) if i not in (5, 8)]
        assert max(others) <= dense / 16, (others, dense)
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.3


def _resumed(rank: int, folder: str, source: str = "gradients") -> float:
    def fit(max_steps: int, resume: str | None) -> torch.Tensor:
        L.seed_everything(0, verbose=False)
        saves = [ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=7, save_top_k=-1)]
        strategy = CompressedDDPStrategy(OneBitAdam(warmup_steps=4, variance_refresh=3, refresh_from=source))
        trainer = L.Trainer(strategy=strategy, max_steps=max_steps,
                            callbacks=saves if resume is None else [], enable_checkpointing=resume is None,
                            **_QUIET)  # fmt: skip
        model = _model()
        trainer.fit(model, datamodule=_data(), ckpt_path=resume)
        return _weights(model)

    whole = fit(12, None)
    resumed = fit(12, os.path.join(folder, "step=7.ckpt"))  # mid-epoch, in the compressed phase
    return float((whole - resumed).abs().max())


@pytest.mark.parametrize("source", ["gradients", "squares"])
def test_a_run_resumed_in_the_compressed_phase_is_bit_identical(tmp_path, source):
    """Momentum, frozen variance, each rank's running second moment, phase, the refreshes' rounding seeds and each
    rank's error-feedback buffers are in the checkpoint (resumed between two variance refreshes)."""
    assert run_on_ranks(_resumed, str(tmp_path), source, init_process_group=False) == [0.0, 0.0]


def _refused(rank: int, case: str) -> str:
    L.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = {}
    model = _model(_Sgd if case == "sgd" else CharGPT)
    if case == "fp16":
        from lightning.pytorch.plugins.precision import MixedPrecision

        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu")]
    trainer = L.Trainer(strategy=CompressedDDPStrategy(OneBitAdam(warmup_steps=2)), max_steps=2,
                        enable_checkpointing=False, **kwargs, **_QUIET)  # fmt: skip
    with pytest.raises((TypeError, ValueError)) as err:
        trainer.fit(model, datamodule=_data())
    return str(err.value)


def test_what_it_cannot_run_is_refused_at_setup_naming_the_fix():
    assert "configure_optimizers returned SGD" in run_on_ranks(_refused, "sgd", init_process_group=False)[0]
    assert "Use precision='bf16-mixed'" in run_on_ranks(_refused, "fp16", init_process_group=False)[0]


def _single_process(rank: int) -> dict[str, Any]:
    import warnings

    from lightning_bigtrain.warnings import NoEffectWarning

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=CompressedDDPStrategy(OneBitAdam(warmup_steps=2), start_method="popen"), max_steps=3,
                        enable_checkpointing=False, **{**_QUIET, "devices": 1})  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(), datamodule=_data())
    return {
        "warned": [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)],
        "optimizer": type(trainer.optimizers[0]).__name__,
    }


def test_a_single_process_warns_naming_onebitadam_and_steps_the_modules_own_optimizer():
    r = run_on_ranks(_single_process, world_size=1, init_process_group=False)[0]
    assert any(m.startswith("`CompressedDDPStrategy(compression=OneBitAdam(") and "single process" in m
               for m in r["warned"]), r["warned"]  # fmt: skip
    assert r["optimizer"] == "AdamW"


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="fraction of the run's steps"):
        OneBitAdam(warmup_steps=1.5)
    with pytest.raises(ValueError, match="at least one step of plain Adam"):
        OneBitAdam(warmup_steps=0)
    with pytest.raises(ValueError, match="compressor's own warmup_steps must be 0"):
        OneBitAdam(compressor=OneBit(warmup_steps=3))
    with pytest.raises(ValueError, match="needs error feedback"):
        OneBitAdam(compressor=OneBit(error_feedback=False))
    with pytest.raises(ValueError, match="is not supported"):
        OneBitAdam(compressor="zip")
    with pytest.raises(ValueError, match=r"variance_refresh=1\)`: pass an int >= 2"):
        OneBitAdam(variance_refresh=1)
    with pytest.raises(TypeError, match=r"track_scale=1\)`: pass True or False"):
        OneBitAdam(track_scale=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"refresh_from='sq'\)`: pass 'squares'"):
        OneBitAdam(refresh_from="sq")
    with pytest.raises(ValueError, match=r"nothing to refresh it from; pass variance_refresh=10"):
        OneBitAdam(refresh_from="squares", variance_refresh=None)
    with pytest.raises(ValueError, match=r"refresh_bits=2\)`: a refresh averages with 8- or 4-bit"):
        OneBitAdam(refresh_bits=2)
    assert "refresh_bits=4" in repr(OneBitAdam(variance_refresh=4, refresh_bits=4))
    assert OneBitAdam(0.1).resolve_warmup(200) == 20
    assert isinstance(CompressedDDPStrategy("onebit_adam").momentum, OneBitAdam)


class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(i % 2), torch.tensor(1.0)


class _Tokens(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 8)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch  # tokens 0 and 1; from step 5 on, token 3, which no step of the warm-up saw (v froze at 0)
        x = torch.full_like(x, 3) if self.global_step >= 5 else x
        return torch.nn.functional.mse_loss(self.head(self.emb(x)).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, betas=(0.9, 0.95))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Pairs(), batch_size=1)


class _RowSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = pl_module.emb.weight[3].detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(float((pl_module.emb.weight[3] - self.before).abs().max()) / 0.01)


def _late_token(rank: int, preconditioned: bool) -> list[float]:
    L.seed_everything(0, verbose=False)
    track = _RowSteps()
    strategy = CompressedDDPStrategy(OneBitAdam(warmup_steps=3, variance_refresh=None, preconditioned=preconditioned))
    trainer = L.Trainer(strategy=strategy, max_steps=10, callbacks=[track], enable_checkpointing=False, **_QUIET)
    trainer.fit(_Tokens())
    return track.steps


@pytest.mark.parametrize("preconditioned", [True, False])
def test_a_token_first_seen_after_the_warm_up_steps_no_further_than_adam_could(preconditioned):
    """Its frozen variance is 0, so the momentum over it would step ``m / eps`` (orders of magnitude beyond the
    learning rate). The step stays within Adam's own bound (about 1.17 learning rates at betas (0.9, 0.95)), and the
    row does move."""
    steps = run_on_ranks(_late_token, preconditioned, init_process_group=False)[0]
    assert max(steps[:3]) == 0.0, steps  # the warm-up: no gradient, no step
    assert max(steps) <= 1.17, steps
    assert max(steps[5:]) > 0.1, steps
