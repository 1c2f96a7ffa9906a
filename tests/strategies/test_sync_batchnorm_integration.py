"""``Trainer(sync_batchnorm=True)`` on 2 CPU ranks: every strategy of this package, and Lightning's DDP given
``GlooSyncBatchNorm``, trains as one process on the two ranks' batches together (weights and running statistics).
Before, ``ZeroStrategy`` and ``DeepSpeedZeroStrategy`` ignored the flag (Lightning's ``ModelParallelStrategy`` and
``DeepSpeedStrategy`` never apply it: per-rank statistics, silently, on GPUs too), and every strategy failed on CPU
(torch's ``nn.SyncBatchNorm`` runs on GPUs only)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_bigtrain.compression import PowerSGD
from lightning_bigtrain.functional.sync_batchnorm import (
    CPUSyncBatchNorm,
    convert_cpu_sync_batchnorm,
    revert_cpu_sync_batchnorm,
)
from lightning_bigtrain.plugins import GlooSyncBatchNorm
from lightning_bigtrain.strategies import CompressedDDPStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.helpers.strategies import strategy

pytestmark = pytest.mark.integration

_NAMES = ["ddp", "cddp", "zero1", "zero2", "zero3", "ds2", "ds3"]
_QUIET = dict(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)  # fmt: skip


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 64),
                                 nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 4))  # fmt: skip
        self.norms: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.norms = [type(m).__name__ for m in self.modules() if "Norm" in type(m).__name__]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(batch: int, rank: int | None = None) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(64, 1, 6, 6, generator=g), torch.randint(0, 4, (64,), generator=g)
    )
    if rank is not None:  # rank r's half of each of the single process's batches
        dataset = torch.utils.data.Subset(dataset, [i for i in range(64) if (i % batch) // (batch // 2) == rank])
        batch //= 2
    return torch.utils.data.DataLoader(dataset, batch_size=batch)


def _state(model: nn.Module) -> torch.Tensor:
    full = [getattr(t, "full_tensor", lambda t=t: t)() for t in model.state_dict().values()]
    return torch.cat([t.detach().float().reshape(-1) for t in full])


def _single(rank: int) -> torch.Tensor:
    model = _Net()
    L.Trainer(devices=1, **_QUIET).fit(model, _data(16))
    return _state(model)


def _fits(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _NAMES:
        model = _Net()
        sync = dict(plugins=[GlooSyncBatchNorm()]) if name == "ddp" else dict(sync_batchnorm=True)
        chosen = CompressedDDPStrategy(PowerSGD(rank=64)) if name == "cddp" else strategy(name)  # (full rank here)
        trainer = L.Trainer(devices=2, strategy=chosen, use_distributed_sampler=False, **sync, **_QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, _data(16, rank))
        if name.startswith("ds"):
            import deepspeed

            inner = trainer.strategy.model.module
            with deepspeed.zero.GatheredParameters(list(inner.parameters())):
                out[name] = (model.norms, _state(inner))
        else:
            out[name] = (model.norms, _state(model))
    split = L.Trainer(devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2), sync_batchnorm=True, **_QUIET)
    try:
        split.fit(_Net(), _data(16, rank))
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_synchronized_batch_norm_trains_as_one_process_on_both_batches_under_every_strategy():
    expected = run_on_ranks(_single, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_fits, init_process_group=False)
    for name in _NAMES:
        norms, state = results[0][name]
        assert set(norms) <= {"CPUSyncBatchNorm", "FSDPCPUSyncBatchNorm"} and len(norms) == 2, (name, norms)
        torch.testing.assert_close(state, expected, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(results[1][name][1], state, rtol=0, atol=0, msg=name)  # identical replicas
    assert "sync_batchnorm=True" in results[0]["refused"] and "tensor or pipeline parallelism" in results[0]["refused"]


def test_conversion_keeps_the_tensors_and_reverts_to_the_original_classes():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.InstanceNorm2d(4), nn.Flatten(), nn.BatchNorm1d(64))
    weight, mean = model[1].weight, model[4].running_mean
    converted = convert_cpu_sync_batchnorm(model)
    assert [type(m).__name__ for m in converted] == ["Conv2d", "CPUSyncBatchNorm", "InstanceNorm2d", "Flatten",
                                                     "CPUSyncBatchNorm"]  # fmt: skip
    assert converted[1].weight is weight and converted[4].running_mean is mean
    x = torch.randn(5, 1, 6, 6)
    torch.testing.assert_close(converted(x), model(x))  # one process (no process group): plain batch norm
    reverted = revert_cpu_sync_batchnorm(converted)
    assert [type(m) for m in reverted][1::3] == [nn.BatchNorm2d, nn.BatchNorm1d] and reverted[1].weight is weight
    assert not any(isinstance(m, CPUSyncBatchNorm) for m in reverted.modules())
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        CPUSyncBatchNorm(4)(torch.randn(4))
