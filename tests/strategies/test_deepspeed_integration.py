"""DeepSpeedZeroStrategy: DeepSpeed's ZeRO engine on 2 CPU ranks over gloo, against the torch engine."""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import (
    DeepSpeedOptions,
    DeepSpeedZeroStrategy,
    ZeroOptions,
    ZeroStrategy,
    zero_strategy,
)
from lightning_bigtrain.strategies.options import resolve_engine
from lightning_bigtrain.strategies.zero import consolidate_checkpoint
from lightning_bigtrain.warnings import NoEffectWarning
from tests.helpers.distributed import free_port, run_on_ranks

pytestmark = pytest.mark.integration

_COMMON = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip


def _model() -> CharGPT:
    return CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=5)


def _data() -> ShakespeareDataModule:
    return ShakespeareDataModule(block_size=32, batch_size=8, subset=1024)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _trajectories(rank: int) -> dict[str, list[float]]:
    """Optimizer steps with accumulation 2, global-norm clipping and the model's warm-up + cosine schedule (its
    length is the run's), from the same seed and data: 50 on the torch engine and DeepSpeed's stage 2, 20 on
    the torch engine and DeepSpeed's stages 1 and 3."""
    out = {}
    runs = {"torch": (ZeroStrategy(2), 50), "torch_short": (ZeroStrategy(2), 20)} | {
        f"deepspeed{stage}": (DeepSpeedZeroStrategy(stage,
                                           deepspeed=DeepSpeedOptions(param_persistence_threshold=0)), steps)
        for stage, steps in ((2, 50), (1, 20), (3, 20))
    }  # fmt: skip
    for name, (strategy, steps) in runs.items():
        L.seed_everything(0, verbose=False)
        losses = _Losses()
        trainer = L.Trainer(strategy=strategy, max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=0.5,
                            enable_checkpointing=False, callbacks=[losses], **_COMMON)  # fmt: skip
        trainer.fit(_model(), datamodule=_data())
        assert trainer.global_step == steps
        out[name] = losses.losses
    return out


def test_loss_trajectories_match_the_torch_engine():
    """Same seed, data, optimizer, schedule, accumulation and clipping: the engines differ only in how they sum
    and partition (bucket layout, fp32 master copies, where the 1/accumulation factor is applied), so the
    per-batch losses agree to float32 rounding: within 1e-5 relative over all 50 steps (measured: 1.6e-7, as DDP
    vs the torch engine). This bound caught a real difference: Lightning's loop divides the loss by
    `accumulate_grad_batches` and DeepSpeed's backward divided it again, so gradients were 1/4 of the true ones
    with accumulation 2 and clipping acted at twice its threshold (0.8% apart after 50 steps)."""
    for r in run_on_ranks(_trajectories, init_process_group=False):
        reference = torch.tensor(r["torch"])
        assert len(reference) == 100
        assert reference[-10:].mean() < reference[:10].mean() - 0.3  # it trained
        for stage in (2, 1, 3):
            losses = torch.tensor(r[f"deepspeed{stage}"])
            ref = reference if stage == 2 else torch.tensor(r["torch_short"])
            torch.testing.assert_close(losses, ref, rtol=1e-5, atol=0, msg=lambda m, s=stage: f"stage {s}: {m}")


def _save_and_export(rank: int, folder: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = _model()
    strategy = DeepSpeedZeroStrategy(3, deepspeed=DeepSpeedOptions(param_persistence_threshold=0))
    checkpoint = ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = L.Trainer(strategy=strategy, max_steps=6, callbacks=[checkpoint], **_COMMON)
    trainer.fit(model, datamodule=_data())
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    partition = {k: p.numel() for k, p in model.named_parameters()}
    return {"weights": weights, "partition": partition, "memory": strategy.memory}


def test_stage3_checkpoint_exports_one_file_plain_lightning_loads(tmp_path):
    results = run_on_ranks(_save_and_export, str(tmp_path), init_process_group=False)
    folder = tmp_path / "last.ckpt"
    assert (folder / "latest").is_file(), "DeepSpeed's checkpoint folder format"
    # Parameters were partitioned: every rank held less than the whole between steps.
    assert all(n == 0 for n in results[0]["partition"].values())
    assert results[0]["memory"]["total"] > 0
    out = consolidate_checkpoint(folder, tmp_path / "model.ckpt")
    loaded = CharGPT.load_from_checkpoint(out, map_location="cpu")  # plain Lightning, no strategy
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, results[0]["weights"][name], rtol=0, atol=0)


def test_registered_names_and_the_auto_rule():
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get("bigtrain_deepspeed_zero3_offload")
    assert isinstance(strategy, DeepSpeedZeroStrategy)
    assert (strategy.stage, strategy.offload_optimizer, strategy.offload_params) == (3, True, True)
    # One class per engine: each call returns an instance of the class called.
    assert type(DeepSpeedZeroStrategy(2)) is DeepSpeedZeroStrategy
    assert type(ZeroStrategy(2, engine="torch")) is ZeroStrategy
    assert type(zero_strategy(2, engine="deepspeed")) is DeepSpeedZeroStrategy
    # auto: the torch engine (measured ahead), unless DeepSpeed options are given.
    assert resolve_engine("auto", stage=3) == "torch"
    assert resolve_engine("auto", stage=2, offload_optimizer=True) == "torch"
    assert type(zero_strategy(3)) is ZeroStrategy
    assert type(zero_strategy(3, deepspeed=DeepSpeedOptions())) is DeepSpeedZeroStrategy
    auto = StrategyRegistry.get("bigtrain_auto_zero2")
    assert type(auto) is ZeroStrategy and auto.stage == 2
    with pytest.warns(NoEffectWarning, match="min_wrap_params=...\\)` has no effect"):
        zero_strategy(3, engine="deepspeed", min_wrap_params=10)
    with pytest.raises(ValueError, match=r"DeepSpeed's knobs need engine='deepspeed'"):
        zero_strategy(3, engine="torch", deepspeed=DeepSpeedOptions())

    class MyDeepSpeed(DeepSpeedZeroStrategy):
        pass

    assert type(MyDeepSpeed(1)) is MyDeepSpeed  # a subclass is what it says


def test_missing_deepspeed_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed: `import deepspeed` fails
    with pytest.raises(ImportError, match=r"`pip install deepspeed`"):
        DeepSpeedZeroStrategy(3)


def _refused_at_setup(rank: int) -> list[str]:
    from lightning_bigtrain.callbacks import MagnitudePruning

    messages = []
    for strategy, callbacks in [
        (DeepSpeedZeroStrategy(3, deepspeed=DeepSpeedOptions(quantized_weights=True)), []),
        (DeepSpeedZeroStrategy(2), [MagnitudePruning(0.5)]),
    ]:
        trainer = L.Trainer(strategy=strategy, max_steps=1, enable_checkpointing=False, callbacks=callbacks,
                            **{**_COMMON, "devices": 1})  # fmt: skip
        try:
            trainer.fit(_model(), datamodule=_data())
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_what_the_engine_cannot_do_is_refused():
    quantized, pruning = run_on_ranks(_refused_at_setup, world_size=1, init_process_group=False)[0]
    assert "DeepSpeedOptions(zero_quantized_weights)` cannot run with accelerator='cpu'" in quantized
    assert "MagnitudePruning cannot prune under DeepSpeedZeroStrategy" in pruning
    with pytest.raises(ValueError, match=r"start_method='popen'"):
        L.Trainer(accelerator="cpu", devices=2,
                  strategy=DeepSpeedZeroStrategy(3, options=ZeroOptions(start_method="fork")))  # fmt: skip


def _offload_on_cpu(rank: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(strategy="bigtrain_deepspeed_zero2_offload", max_steps=2, enable_checkpointing=False,
                            **{**_COMMON, "devices": 1})  # fmt: skip
        trainer.fit(_model(), datamodule=_data())
    return [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]


def test_offload_on_cpu_warns_and_trains():
    messages = run_on_ranks(_offload_on_cpu, world_size=1, init_process_group=False)[0]
    assert any("offload_optimizer=True)` has no effect with accelerator='cpu'" in m for m in messages), messages


def _buffers_at_third_forward(rank: int, broadcast: bool) -> torch.Tensor:
    """BatchNorm statistics as the third training forward sees them (after that step's broadcast, before its own
    batch updates them)."""
    from lightning_bigtrain.data import FashionMNISTDataModule
    from lightning_bigtrain.models import FashionCNN

    L.seed_everything(0, verbose=False)
    model = FashionCNN(channels=(8, 16))
    seen: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: object) -> None:
        if module.training:
            seen.append(torch.cat([b.detach().reshape(-1).clone() for b in module.buffers() if b.is_floating_point()]))

    model.register_forward_pre_hook(record)
    strategy = DeepSpeedZeroStrategy(1, options=ZeroOptions(broadcast_buffers=broadcast))
    trainer = L.Trainer(strategy=strategy, max_steps=3, enable_checkpointing=False, **_COMMON)
    trainer.fit(model, datamodule=FashionMNISTDataModule(batch_size=16, subset=96))
    return seen[2]


def test_buffers_are_broadcast_before_every_step_and_not_when_switched_off():
    """DeepSpeed broadcasts buffers only at start-up; ZeroOptions(broadcast_buffers=True) makes every step start from
    rank 0's BatchNorm statistics, as DDP and the torch engine do (the ranks see different batches, so without it
    the statistics drift apart)."""
    on = run_on_ranks(_buffers_at_third_forward, True, init_process_group=False)
    off = run_on_ranks(_buffers_at_third_forward, False, init_process_group=False)
    assert torch.equal(on[0], on[1])
    assert not torch.equal(off[0], off[1])


def _fit_on_two_process_groups(rank: int, without_release_function: bool) -> int:
    """Two DeepSpeed fits in one process, the first run's process group destroyed by torch in between (as a
    notebook or a sweep that re-initialises its group does), not through DeepSpeed."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    release = None
    if without_release_function:  # some DeepSpeed releases (0.19.7 here) have no function to drop the cached groups
        release = groups.__dict__.pop("_release_process_group_references", None)
    steps = []
    for _ in range(2):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(strategy=DeepSpeedZeroStrategy(2), max_steps=2, enable_checkpointing=False, **_COMMON)
        trainer.fit(_model(), datamodule=_data())
        steps.append(trainer.global_step)
        port = [free_port()]
        dist.broadcast_object_list(port, src=0)
        os.environ["MASTER_PORT"] = str(port[0])  # a fresh rendezvous for the next group
        dist.destroy_process_group()
    if release is not None:
        groups._release_process_group_references = release
    return sum(steps)


@pytest.mark.parametrize("without_release_function", [False, True], ids=["as-installed", "without-release-function"])
def test_a_second_fit_on_a_new_process_group_does_not_use_deepspeeds_stale_groups(without_release_function):
    """DeepSpeed caches its process groups for the life of the process; a group destroyed behind its back left
    them stale and the next engine failed in its first broadcast ("Group ... is not registered"). CI installed a
    DeepSpeed without ``_release_process_group_references`` and failed there: the globals are reset by name."""
    assert run_on_ranks(_fit_on_two_process_groups, without_release_function, init_process_group=False) == [4, 4]


def _linear_after_a_stage3_fit(rank: int) -> dict[str, bool]:
    import torch.nn.functional as F

    original = F.linear
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=DeepSpeedZeroStrategy(3), max_steps=2, enable_checkpointing=False,
                        **{**_COMMON, "devices": 1})  # fmt: skip
    trainer.fit(_model(), datamodule=_data())
    return {"restored": F.linear is original, "trained": trainer.global_step == 2}


def test_a_stage3_fit_leaves_torchs_linear_as_it_found_it():
    """DeepSpeed's stage-3 initialisation replaces ``torch.nn.functional.linear`` for the life of the process ("This
    will persist unless manually reset"): every later model in the process (a notebook's next fit, a sweep's next
    trial, any strategy) then ran DeepSpeed's autograd function, whose CUDA kernels round differently (found by the
    GPU check: a compiled fit after a stage-3 fit no longer matched eager). The strategy puts torch's back."""
    assert run_on_ranks(_linear_after_a_stage3_fit, world_size=1, init_process_group=False) == [
        {"restored": True, "trained": True}
    ]


def _bf16_norms(rank: int) -> dict:
    """DeepSpeed's stages 2 and 3 under bf16-mixed on models with batch norms (torchvision's ResNet-18) and with a
    layer norm meeting an fp32 activation made in forward (Lightning's demo Transformer adds an fp32 position table)."""
    from benchmarks.conformance import FAMILIES, _build, _data

    out: dict = {}
    for family in ("tv_resnet18", "lightning_demo_transformer"):
        for stage in (2, 3):
            L.seed_everything(0, verbose=False)
            model = _build(FAMILIES[family], 0)
            losses = _Losses()
            strategy = DeepSpeedZeroStrategy(stage, deepspeed=DeepSpeedOptions(param_persistence_threshold=0))
            trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=8, enable_checkpointing=False,
                                callbacks=[losses], **_COMMON)  # fmt: skip
            trainer.fit(model, datamodule=_data(FAMILIES[family].data))
            hooks = sum("_match_norms_to_engine" in getattr(h, "__qualname__", "")
                        for m in model.modules() for h in m._forward_pre_hooks.values())  # fmt: skip
            out[f"{family}/{stage}"] = (losses.losses, hooks)
    return out


def test_bf16_mixed_trains_models_with_normalization_layers():
    """DeepSpeed casts the module's parameters to bf16 and nothing else: ResNet-18 failed at its first batch norm
    (bf16 weight, fp32 running statistics: "expected scalar type BFloat16 but found Float") and the demo
    Transformer at its first matmul (the fp32 position table: "expected m1 and m2 to have the same dtype"), as under
    Lightning's DeepSpeedStrategy. Now the batch norms' statistics are in bf16, norms take their input in their
    weight's dtype, and the forward runs under autocast: both train, and the hooks are gone after the fit."""
    for r in run_on_ranks(_bf16_norms, init_process_group=False):
        for name, (losses, hooks) in r.items():
            assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))), name
            assert sum(losses[-3:]) / 3 < losses[0], (name, losses)  # the conformance matrix's "trains"
            assert hooks == 0, name
