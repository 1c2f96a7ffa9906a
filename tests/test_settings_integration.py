"""Generic tests over the settings table: fit on 2 gloo ranks with identical replicas, exact resume, bad input
rejected."""

from __future__ import annotations

import contextlib
import math
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.functional.sharding import is_replica, local_view
from lightning_bigtrain.strategies import DeepSpeedOptions, DeepSpeedZeroStrategy, ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.helpers.settings import SETTINGS, by_name

pytestmark = pytest.mark.integration

_COMMON = dict(
    accelerator="cpu",
    devices=2,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    deterministic=True,
)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: sharded (DTensor) parameters are gathered."""
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else t).detach().reshape(-1).float()


def _gathered(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """DeepSpeed's stage 3 keeps each parameter partitioned between steps: gather them to read them whole."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_tensor")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def _named_params(model: torch.nn.Module, strategy: object) -> dict[str, torch.Tensor]:
    """Each parameter this rank holds, whole (a pipeline stage holds its own blocks and what every stage holds), in
    the module's own layout (a tensor-parallel split of packed q/k/v rows reorders them: put back)."""
    from lightning_bigtrain.functional.tensor_parallel import unpack_rows

    plan = getattr(strategy, "tensor_parallel_plan", None)
    packed = plan.packed() if plan is not None else {}
    out = {}
    with _gathered(model):
        for n, p in model.named_parameters():
            if n in packed:
                whole = p.full_tensor().detach()  # type: ignore[attr-defined]
                out[n] = unpack_rows(whole, packed[n][0], plan.degree, packed[n][1]).reshape(-1).float()
            else:
                out[n] = _full(p)
    return out


def _flat_state(model: torch.nn.Module) -> torch.Tensor:
    """Parameters and buffers (BatchNorm running statistics included)."""
    with _gathered(model):
        return torch.cat([_full(t) for t in model.state_dict().values() if t.is_floating_point()])


class _Interrupt(L.Callback):
    """Stops a run configured for more epochs after ``epochs`` epochs, as a pre-empted job would;
    records the step training started from (to prove a resumed run did not start over)."""

    def __init__(self, epochs: int | None = None) -> None:
        self.epochs = epochs
        self.start_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.epochs is not None and trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def _replicas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each replicated parameter as this rank holds it, before any gather (shards are not replicas)."""
    return {n: local_view(p).detach().clone() for n, p in model.named_parameters() if is_replica(p)}


class _Perturb(L.Callback):
    """Adds 1e-2 to the first parameter rank 1 holds (its shard, or its replica) at the end of training."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            with torch.no_grad():
                p = next(pl_module.parameters())
                local = getattr(p, "ds_tensor", None)
                (local if local is not None else local_view(p)).add_(1e-2)


def _replicated_twin(strategy: object) -> object:
    """The same engine at stage 1 (parameters replicated, the same step-seeded dropout), for rows that shard
    parameters; a replica on one rank is checked against the other rank's."""
    if isinstance(strategy, DeepSpeedZeroStrategy):
        buckets = DeepSpeedOptions(reduce_bucket_size=5000, allgather_bucket_size=5000)
        return DeepSpeedZeroStrategy(1, compression=strategy.compression, options=strategy.options, deepspeed=buckets)
    if isinstance(strategy, ZeroStrategy):
        return ZeroStrategy(1, min_wrap_params=strategy.min_wrap_params, compression=strategy.compression,
                            options=strategy.options)  # fmt: skip
    raise AssertionError(f"no replicated twin for {strategy!r}")


def _fit_and_resume(rank: int, name: str, ckpt_dir: str, perturb: bool = False) -> dict:
    setting = by_name(name)
    kwargs = dict(limit_train_batches=3, limit_val_batches=1, num_nodes=setting.num_nodes, **_COMMON)
    if setting.num_nodes > 1:  # this rank's place among the "nodes" of 2 ranks
        os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2))

    def run(stop_after: int | None, ckpt_path: str | None, replicated: bool = False, extra_callbacks=()):
        L.seed_everything(0, verbose=False)
        model = setting.model()
        extra = setting.trainer_kwargs()
        if replicated:
            twin = setting.replicated_twin
            extra["strategy"] = twin() if twin is not None else _replicated_twin(extra["strategy"])
        probe = _Interrupt(stop_after)
        extra.setdefault("callbacks", []).extend([probe, *extra_callbacks])
        if stop_after is not None:
            extra["callbacks"].append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
        trainer = L.Trainer(max_epochs=2, enable_checkpointing=stop_after is not None, **kwargs, **extra)
        trainer.fit(model, datamodule=setting.data(), ckpt_path=ckpt_path)
        assert trainer.global_step == 3 * (stop_after or 2)
        assert probe.start_step == (3 if ckpt_path else 0), "the resumed run did not continue from step 3"
        return _flat_state(model), model, trainer

    uninterrupted, model, trainer = run(None, None, extra_callbacks=[_Perturb()] if perturb else [])
    pipelined = getattr(trainer.strategy, "pipeline_plan", None) is not None
    replicas = _replicas(model)
    sharded = pipelined or any(not is_replica(p) for p in model.parameters())
    out = {
        "replicas": replicas,
        "pipelined": pipelined,
        "sharded": sharded,
        "weights": _named_params(model, trainer.strategy),
        "loss": float(trainer.callback_metrics["train_loss"]),
    }
    if sharded:  # no rank holds what the other holds: the reference is the same run with replicated parameters
        _, twin_model, twin_trainer = run(None, None, replicated=True)
        out["ddp_weights"] = _named_params(twin_model, twin_trainer.strategy)
    if not perturb:
        run(1, None)
        out["uninterrupted"] = uninterrupted
        out["resumed"] = run(None, f"{ckpt_dir}/last.ckpt")[0]
    return out


def replica_problems(results: list[dict], ddp_atol: float, mask_slack: float = 0.0) -> list[str]:
    """What differs that must not: a replicated parameter between the ranks' own copies (compared before any
    gather), or, where parameters are sharded, the gathered weights from those of the same run on the same engine
    at stage 1, whose parameters are replicas (and checked as such in their own rows; tensor- and pipeline-parallel
    rows against DDP ranks that all step on the same batches)."""
    problems = []
    first = results[0]["replicas"]
    for other in results[1:]:
        second = other["replicas"]
        if first.keys() != second.keys() and not results[0]["pipelined"]:  # a pipeline stage holds its own blocks
            problems.append(f"ranks replicate different parameters: {sorted(first.keys() ^ second.keys())}")
        problems += [
            f"replica {n} differs between ranks" for n in first if n in second and not torch.equal(first[n], second[n])
        ]
    for r in results:
        if r["sharded"]:
            names = list(r["weights"])  # what this rank holds, each against the twin's same parameter
            ours = torch.cat([r["weights"][n] for n in names])
            twin = torch.cat([r["ddp_weights"][n] for n in names])
            one_zero = (ours == 0) != (twin == 0)
            if one_zero.float().mean().item() > mask_slack:
                problems.append(f"{int(one_zero.sum())} weights are zero in only one of the runs (> {mask_slack:.0%})")
            diff = (ours - twin)[~one_zero].abs().max().item()
            if not diff <= ddp_atol:
                problems.append(f"sharded weights differ from the stage-1 run by {diff:.2e} (> {ddp_atol:.0e})")
    return problems


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_fits_with_identical_replicas_and_resumes_where_the_uninterrupted_run_ends(setting, tmp_path):
    """One spawn per row (process start-up dominates a tiny fit): a 2-epoch fit on 2 ranks, then the same run
    stopped after epoch 1 and resumed from its checkpoint; rows with sharded parameters also run at stage 1."""
    results = run_on_ranks(
        _fit_and_resume, setting.name, str(tmp_path), world_size=2 * setting.num_nodes, init_process_group=False
    )
    for r in results:
        assert math.isfinite(r["loss"])
        torch.testing.assert_close(r["resumed"], r["uninterrupted"], rtol=0, atol=setting.resume_atol)
    # Buffers (BatchNorm statistics) are per rank between the broadcasts at each step start: parameters only.
    assert not replica_problems(results, setting.ddp_atol, setting.mask_slack)


@pytest.mark.parametrize("name", ["ddp_cnn", "zero3_gpt", "ds_zero3_gpt"])
def test_the_replica_check_fails_when_one_rank_diverges(name, tmp_path):
    """A replica (DDP), or a shard (ZeRO-3 on either engine), nudged on rank 1 only is reported."""
    results = run_on_ranks(_fit_and_resume, name, str(tmp_path), True, init_process_group=False)
    problems = replica_problems(results, by_name(name).ddp_atol)
    assert problems and all(("differs between ranks" in p) != results[0]["sharded"] for p in problems), problems


_BAD = [(s, b) for s in SETTINGS for b in s.bad_inputs]


@pytest.mark.parametrize(("setting", "bad"), _BAD, ids=[f"{s.name}-{b.id}" for s, b in _BAD])
def test_rejects_bad_input(setting, bad):
    with pytest.raises(bad.error, match=bad.match):
        bad.call()
