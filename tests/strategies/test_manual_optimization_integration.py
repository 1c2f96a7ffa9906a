"""Manual optimization (``automatic_optimization = False``) under this package's strategies, on 2 CPU ranks: the
weights end where Lightning's DDP ends them, or the strategy refuses with the reason.

Two users' patterns: gradient accumulation written by hand (``manual_backward`` every micro-batch, clipping and a
step every second one, as Lightning's manual-optimization guide shows it) and a GAN's two optimizers, each phase
toggling the other's parameters off, the discriminator's last layer too small to be a sharding unit of its own.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bigtrain.compression import Cast
from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import CompressedDDPStrategy, DeepSpeedZeroStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_COMMON = dict(accelerator="cpu", devices=2, limit_val_batches=0, enable_checkpointing=False, logger=False,
               enable_progress_bar=False, enable_model_summary=False)  # fmt: skip


class ManualGPT(CharGPT):
    """The char-GPT trained by hand: ``accumulate`` micro-batches per step, clipped by the global norm."""

    def __init__(self, accumulate: int = 2, clip: str | None = "norm") -> None:
        super().__init__(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=3)
        self.automatic_optimization = False
        self.accumulate = accumulate
        self.clip = clip

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self._loss(batch)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip is not None:
                self.clip_gradients(optimizer, gradient_clip_val=0.25, gradient_clip_algorithm=self.clip)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        self.log("train_loss", loss)
        return loss


def _flat(model: nn.Module) -> torch.Tensor:
    def full(t: torch.Tensor) -> torch.Tensor:
        f = getattr(t, "full_tensor", None)
        return (f() if callable(f) else t).detach().reshape(-1).float().cpu()

    return torch.cat([full(p) for p in model.parameters()])


def _fit_gpt(strategy, accumulate: int, clip: str | None = "norm") -> torch.Tensor:
    L.seed_everything(0, verbose=False)
    model = ManualGPT(accumulate, clip)
    trainer = L.Trainer(strategy=strategy, max_steps=6, **_COMMON)
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=256))
    assert trainer.global_step == 6
    return _flat(model)


def _accumulation(rank: int) -> dict[str, torch.Tensor]:
    strategies = {"ddp": lambda: "ddp", "zero1": lambda: ZeroStrategy(stage=1),
                  "zero2": lambda: ZeroStrategy(stage=2), "zero3": lambda: ZeroStrategy(stage=3, min_wrap_params=1000),
                  "deepspeed3": lambda: DeepSpeedZeroStrategy(3)}  # fmt: skip
    out = {name: _fit_gpt(make(), accumulate=2) for name, make in strategies.items()}
    # DeepSpeed's stages 1-2 accumulate only through the engine: one backward per step, clipped by the engine.
    out["ddp_single"] = _fit_gpt("ddp", accumulate=1)
    out["deepspeed2_single"] = _fit_gpt(DeepSpeedZeroStrategy(2), accumulate=1)
    return out


def test_manual_accumulation_and_clipping_match_ddp():
    """ZeRO-1 summed the earlier micro-batches' already averaged gradients into the next reduce-scatter (half of
    them lost in the average), and lost the first step whole: Lightning's ``module.zero_grad()`` before the run left
    the parameters' gradients outside the buckets. DeepSpeed's engine ignored ``clip_gradients``."""
    for r in run_on_ranks(_accumulation, init_process_group=False):
        for name in ("zero1", "zero2", "zero3", "deepspeed3"):
            torch.testing.assert_close(r[name], r["ddp"], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(r["deepspeed2_single"], r["ddp_single"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(r["ddp"], r["ddp_single"])


def _deepspeed_refusals(rank: int) -> dict[str, str]:
    out = {}
    for name, (accumulate, clip) in {"accumulate": (2, "norm"), "value": (1, "value")}.items():
        try:
            _fit_gpt(DeepSpeedZeroStrategy(2), accumulate=accumulate, clip=clip)
            out[name] = "trained"
        except (RuntimeError, ValueError) as err:
            out[name] = str(err)
    return out


def test_deepspeed_stage2_refuses_manual_accumulation_and_clipping_by_value():
    for r in run_on_ranks(_deepspeed_refusals, init_process_group=False):
        assert "`manual_backward` ran again before the optimizer stepped" in r["accumulate"]
        assert "accumulate_grad_batches" in r["accumulate"]
        assert "clips by the global norm only" in r["value"]


class GAN(L.LightningModule):
    """Two optimizers, manual optimization; ``disc.2`` (65 parameters) stays in the root sharding unit."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16))
        self.disc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        noise = torch.Generator().manual_seed(7 * batch_idx + self.global_rank)
        z = torch.randn(real.shape[0], 8, generator=noise)
        self.toggle_optimizer(d_opt)
        fake = self.gen(z).detach()
        d_loss = nn.functional.softplus(-self.disc(real)).mean() + nn.functional.softplus(self.disc(fake)).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, 1.0, "norm")
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = nn.functional.softplus(-self.disc(self.gen(z))).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def predict_step(self, batch, batch_idx):
        return self.gen(batch[0][:, :8])

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)]


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(128, 16, generator=torch.Generator().manual_seed(0)) * 0.5 + 1),
                      batch_size=16)  # fmt: skip


def _gan(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    strategies = {
        "ddp": lambda: "ddp_find_unused_parameters_true",
        "zero1": lambda: ZeroStrategy(stage=1),
        "zero3": lambda: ZeroStrategy(stage=3, min_wrap_params=100),
        "fp16": lambda: CompressedDDPStrategy(Cast("fp16"), find_unused_parameters=True),
    }
    out = {}
    for name, make in strategies.items():
        L.seed_everything(0, verbose=False)
        model = GAN()
        trainer = L.Trainer(strategy=make(), max_epochs=1, **_COMMON)
        trainer.fit(model, train_dataloaders=_loader())
        weights = _flat(model)
        predictions = trainer.predict(model, dataloaders=_loader())
        assert predictions is not None
        out[name] = (weights, torch.cat(predictions))  # type: ignore[arg-type]
    return out


def test_gan_with_two_optimizers_matches_ddp_and_predicts():
    """ZeRO-3 met the root unit's parameters sharded in the generator phase (backward had resharded them inside
    the step); CompressedDDPStrategy with find_unused_parameters=True aborted the ranks (its exchange thread and
    DDP's map of used parameters shared a process group)."""
    results = run_on_ranks(_gan, init_process_group=False)
    for r in results:
        ddp_weights, ddp_predictions = r["ddp"]
        for name, atol in (("zero1", 1e-6), ("zero3", 1e-6), ("fp16", 1e-4)):
            weights, predictions = r[name]
            torch.testing.assert_close(weights, ddp_weights, rtol=1e-5, atol=atol, msg=name)
            torch.testing.assert_close(predictions, ddp_predictions, rtol=1e-4, atol=atol * 10, msg=name)
    torch.testing.assert_close(results[0]["zero3"][0], results[1]["zero3"][0], rtol=0, atol=0)
