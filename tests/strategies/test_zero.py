"""ZeroStrategy without processes: names, validation, automatic sharding units."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_bigtrain.functional.sharding import auto_wrap_targets
from lightning_bigtrain.models import CharGPT, FashionCNN
from lightning_bigtrain.models.gpt import Block
from lightning_bigtrain.strategies import ZeroOptions, ZeroStrategy, register_all

NAMES = {
    "bigtrain_zero1",
    "bigtrain_zero2",
    "bigtrain_zero3",
    "bigtrain_zero2_offload",
    "bigtrain_zero3_offload",
    "bigtrain_zero3_tp2",
    "bigtrain_zero3_tp4",
    "bigtrain_zero3_pp2",
    "bigtrain_zero3_pp4",
    "bigtrain_ddp_powersgd",
    "bigtrain_ddp_topk",
    "bigtrain_ddp_onebit",
    "bigtrain_ddp_int8",
    "bigtrain_ddp_fp16",
    "bigtrain_ddp_int4",
    "bigtrain_ddp_bf16",
    "bigtrain_ddp_onebit_adam",
    "bigtrain_ddp_auto",
    "bigtrain_deepspeed_zero1",
    "bigtrain_deepspeed_zero2",
    "bigtrain_deepspeed_zero3",
    "bigtrain_deepspeed_zero2_offload",
    "bigtrain_deepspeed_zero3_offload",
    "bigtrain_auto_zero1",
    "bigtrain_auto_zero2",
    "bigtrain_auto_zero3",
}


def test_registered_names_are_exactly_ours_and_registration_is_idempotent():
    register_all()
    register_all()
    ours = {n for n in StrategyRegistry.available_strategies() if n.startswith("bigtrain_")}
    assert ours == NAMES
    offload = StrategyRegistry["bigtrain_zero3_offload"]
    assert offload["init_params"] == {"stage": 3, "offload_optimizer": True, "offload_params": True}
    assert StrategyRegistry["bigtrain_zero2_offload"]["init_params"]["offload_params"] is False


def test_trainer_resolves_the_names():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="bigtrain_zero2", logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, r"`ZeroStrategy\(stage=4\)` is not supported: stage must be 1, 2 or 3\."),
        ({"stage": 0}, r"stage must be 1, 2 or 3"),
        ({"stage": 1, "offload_optimizer": True}, r"stage=1, offload_optimizer=True\)` is not supported"),
        ({"stage": 2, "offload_params": True}, r"offload_params=True\)` is not supported"),
        ({"min_wrap_params": 0}, r"min_wrap_params=0"),
        (
            {"stage": 1, "options": ZeroOptions(save_distributed_checkpoint=False)},
            r"options=ZeroOptions\(save_distributed_checkpoint=False\)\)` is not supported",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_offload_params_implies_offload_optimizer():
    assert ZeroStrategy(stage=3, offload_params=True).offload_optimizer


def test_auto_wrap_picks_repeated_blocks_of_a_gpt():
    model = CharGPT(n_layer=3, n_embd=64, n_head=2)
    targets = auto_wrap_targets(model, min_params=1000)
    assert len(targets) == 3 and all(isinstance(t, Block) for t in targets)


def test_auto_wrap_falls_back_to_large_submodules():
    model = nn.Sequential(nn.Linear(10, 2000), nn.ReLU(), nn.Sequential(nn.Linear(2000, 5000), nn.Tanh()))
    targets = auto_wrap_targets(model, min_params=1_000_000)
    assert targets == [model[2][0]]
    # Below the threshold everything stays with the root unit.
    assert auto_wrap_targets(FashionCNN(channels=(4, 8)), min_params=10**6) == []


def test_auto_wrap_units_never_nest():
    model = nn.ModuleList([nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)) for _ in range(2)])
    targets = auto_wrap_targets(model, min_params=100)
    ids = {id(m) for t in targets for m in t.modules() if m is not t}
    assert not any(id(t) in ids for t in targets)


def test_url_with_missing_filesystem_names_the_package(monkeypatch):
    import fsspec

    from lightning_bigtrain.strategies.zero import _is_url

    def missing(protocol):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ImportError, match=r"lightning_bigtrain\[s3\]"):
        _is_url("s3://bucket/ckpt")
    assert not _is_url("/local/path")


@pytest.mark.parametrize("bad", [-1, 1.5, "128k", True])
def test_host_mmap_threshold_is_validated(bad):
    with pytest.raises(ValueError, match=r"ZeroOptions\(host_mmap_threshold="):
        ZeroOptions(host_mmap_threshold=bad)
    assert ZeroOptions(host_mmap_threshold=None).host_mmap_threshold is None


def test_host_mmap_threshold_warns_where_it_cannot_act(monkeypatch):
    import lightning_bigtrain.strategies._common as common
    from lightning_bigtrain.warnings import NoEffectWarning

    monkeypatch.setattr(common, "set_mmap_threshold", lambda nbytes: False)  # a C library without mallopt
    with pytest.warns(NoEffectWarning, match=r"host_mmap_threshold=8388608\)` has no effect"):
        ZeroStrategy(3)._fix_host_allocator(states_on_host=True)


def test_compression_under_mixed_precision_keeps_fp32_replicas_and_says_so():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_bigtrain.warnings import NoEffectWarning

    strategy = ZeroStrategy(1, compression="topk")
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert strategy._flat_param_dtype(compressed=False) == torch.bfloat16
    with pytest.warns(NoEffectWarning, match=r"keeps fp32 replicated parameters"):
        assert strategy._flat_param_dtype(compressed=True) is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"param_dtype": torch.float64}, r"FlatShardedOptimizer\(param_dtype=torch.float64\)"),
    ({"param_dtype": torch.bfloat16, "compression": object()}, r"param_dtype=...\)` cannot be combined"),
])  # fmt: skip
def test_flat_engine_mixed_precision_arguments_are_checked(kwargs, match):
    from lightning_bigtrain.engines.flat_shard import FlatShardedOptimizer

    with pytest.raises(ValueError, match=match):
        FlatShardedOptimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters()), mesh=None, **kwargs)
