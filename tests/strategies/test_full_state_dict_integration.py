"""What the module holds after ``fit``, and ``lightning_bigtrain.utilities.full_state_dict``: the fitted weights whole,
in the layout of the model as written, under every layout, on 2 CPU ranks. The reference is the checkpoint the same
run writes after ``fit``, consolidated (``consolidate_checkpoint``, DeepSpeed's ``zero_to_fp32`` for its folders)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import DeepSpeedZeroStrategy, ZeroStrategy
from lightning_bigtrain.strategies.zero import consolidate_checkpoint
from lightning_bigtrain.utilities import full_state_dict
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


_SIZE = dict(block_size=32, n_layer=2, n_head=4, n_embd=32, warmup_steps=1)


def _model() -> CharGPT:
    return CharGPT(**_SIZE)


class _ShardsItself(CharGPT):
    """A user's FSDP2 module for Lightning's own ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


def _fit(
    strategy: Any,
    precision: str = "32-true",
    callbacks: list[Any] | None = None,
    validate: bool = False,
    ckpt_path: str | None = None,
    max_steps: int = 3,
) -> tuple[CharGPT, L.Trainer]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (32, 33))
    torch.manual_seed(1)
    model = _ShardsItself(**_SIZE) if type(strategy) is ModelParallelStrategy else _model()
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=max_steps,
                        callbacks=callbacks or [], val_check_interval=1 if validate else None,
                        limit_val_batches=1 if validate else 0, num_sanity_val_steps=0, **_QUIET)  # fmt: skip
    trainer.fit(model, data, data if validate else None, ckpt_path=ckpt_path)
    return model, trainer


def _consolidated(trainer: L.Trainer, folder: str, name: str) -> dict[str, torch.Tensor] | None:
    """The run's checkpoint written after ``fit``, consolidated on rank 0 (None on the others)."""
    path = os.path.join(folder, name)
    trainer.save_checkpoint(path)
    if trainer.global_rank != 0:
        return None
    if os.path.isfile(path):  # Lightning's DDP: one file already
        return torch.load(path, weights_only=False)["state_dict"]
    saved = torch.load(consolidate_checkpoint(path, path + ".pt"), weights_only=False)
    return saved.get("state_dict", saved)


class _ReferenceEMA(L.Callback):
    """The EMA ``EMAWeightAveraging(decay)`` should hold, kept by hand after it at every step: of the fp32 masters
    (gathered whole), and of the bf16 replicas the module holds (what it averaged before). At step 2 the run saves a
    checkpoint, whose average is read back on rank 0."""

    def __init__(self, decay: float, folder: str | None = None) -> None:
        self.decay, self.folder = decay, folder
        self.masters: list[torch.Tensor] = []
        self.replicas: list[torch.Tensor] = []
        self.saved: tuple[dict[str, torch.Tensor] | None, list[torch.Tensor]] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if isinstance(trainer.strategy, DeepSpeedZeroStrategy):  # its own assembly of a parameter's fp32 master
            from deepspeed.utils import safe_get_full_fp32_param

            sixteen = [p for p in pl_module.parameters() if p.dtype == torch.bfloat16]
            whole = {id(p): safe_get_full_fp32_param(p) for p in sixteen}
        else:
            whole = {id(p): m for o in trainer.strategy._flat_optimizers() for p, m in o.whole_masters()}  # type: ignore[attr-defined]
        params = list(pl_module.parameters())
        for mine, now in ((self.masters, [whole.get(id(p), p) for p in params]), (self.replicas, params)):
            if not mine:
                mine += [t.detach().float().clone() for t in now]
            else:
                for a, t in zip(mine, now, strict=True):
                    a.lerp_(t.detach().float(), 1 - self.decay)
        if trainer.global_step == 2 and self.folder is not None:
            saved = _consolidated(trainer, self.folder, "ema_mid")
            self.saved = (saved, [a.clone() for a in self.masters])


def _mixed_precision_ends_fp32(rank: int, folder: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    out: dict[str, Any] = {}
    for stage in (1, 2):
        model, trainer = _fit(ZeroStrategy(stage=stage), "bf16-mixed")
        held = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[stage] = (held, _consolidated(trainer, folder, f"stage{stage}"))
    averaging = EMAWeightAveraging(decay=0.5)
    reference = _ReferenceEMA(0.5, folder)
    model, trainer = _fit(ZeroStrategy(stage=2), "bf16-mixed", [averaging, reference], validate=True)  # swaps
    average = averaging._average_model.module  # type: ignore[union-attr]
    out["ema"] = [(p.dtype, torch.equal(p, a)) for p, a in zip(model.parameters(), average.parameters(), strict=True)]
    # The average against the EMA of the masters, and of the replicas (the gap the masters close)
    triples = zip(average.parameters(), reference.masters, reference.replicas, strict=True)
    out["ema_gap"] = [((a - m).abs().max().item(), (r - m).abs().max().item()) for a, m, r in triples]
    assert reference.saved is not None
    saved, expected = reference.saved
    if saved is not None:  # rank 0: the checkpoint saved at step 2 holds the average of the masters to that step
        names = [n for n, _ in model.named_parameters()]
        out["ema_saved"] = [(saved[n] - e).abs().max().item() for n, e in zip(names, expected, strict=True)]
    # The average through 3 validations (swapped into the bf16 module and back): still fp32, not its bf16 rounding.
    out["ema_rounded"] = _bf16_share(average)
    # DeepSpeed's engine (a bf16 module): Lightning's swap rounded the average too, and it averaged the bf16 module.
    averaging = EMAWeightAveraging(decay=0.5)
    reference = _ReferenceEMA(0.5)
    _fit(DeepSpeedZeroStrategy(stage=2), "bf16-mixed", [averaging, reference], validate=True)
    average = averaging._average_model.module  # type: ignore[union-attr]
    out["ds_ema_rounded"] = _bf16_share(average)
    triples = zip(average.parameters(), reference.masters, reference.replicas, strict=True)
    out["ds_ema_gap"] = [((a - m).abs().max().item(), (r - m).abs().max().item()) for a, m, r in triples]
    return out


class _HeldAtStart(L.Callback):
    """What a resumed run starts from, whole (every rank): the module's fp32 weights (the masters, stages 1-2) and
    ``averaging``'s average."""

    def __init__(self, averaging: Any) -> None:
        self.averaging = averaging
        self.weights: list[torch.Tensor] = []
        self.average: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def whole(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()

        flats = trainer.strategy._flat_optimizers()  # type: ignore[attr-defined]
        masters = {id(p): m for o in flats for p, m in o.whole_masters()}
        self.weights = [whole(masters.get(id(p), p)) for p in pl_module.parameters()]
        self.average = [whole(a) for a in self.averaging._average_model.module.parameters()]


def _averaged_resumes(rank: int, folder: str) -> dict[str, Any]:
    """``EMAWeightAveraging`` in bf16-mixed, saved at step 2 and resumed: in its own layout (stage 2) to the end, and
    in another (stage 2 -> 3, 3 -> 2), where what the resumed run starts from is compared with what was saved."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    def ends(model: torch.nn.Module, averaging: Any) -> list[torch.Tensor]:
        module = averaging._average_model.module
        return [t.detach().clone() for t in [*model.parameters(), *module.parameters()]]

    out: dict[str, Any] = {}
    averaging = EMAWeightAveraging(decay=0.5)
    held = {stage: _HeldAtStart(averaging) for stage in (2, 3)}
    model, _ = _fit(ZeroStrategy(stage=2), "bf16-mixed", [averaging, _SaveAt(2, folder, "s2"), held[2]])
    out["whole"] = ends(model, averaging)
    out["saved2"] = held[2].weights, held[2].average  # (read at step 2, after the save: see _SaveAt)
    averaging = EMAWeightAveraging(decay=0.5)
    ckpt = os.path.join(folder, "s2")
    model, _ = _fit(ZeroStrategy(stage=2), "bf16-mixed", [averaging], ckpt_path=ckpt)
    out["resumed"] = ends(model, averaging)
    averaging = EMAWeightAveraging(decay=0.5)
    start = _HeldAtStart(averaging)
    _fit(ZeroStrategy(stage=3), "bf16-mixed", [averaging, start], ckpt_path=ckpt)
    out["2>3"] = start.weights, start.average
    averaging = EMAWeightAveraging(decay=0.5)
    held3 = _HeldAtStart(averaging)
    _fit(ZeroStrategy(stage=3), "bf16-mixed", [averaging, _SaveAt(2, folder, "s3"), held3], max_steps=2)
    out["saved3"] = held3.weights, held3.average
    averaging = EMAWeightAveraging(decay=0.5)
    start = _HeldAtStart(averaging)
    _fit(ZeroStrategy(stage=2), "bf16-mixed", [averaging, start], ckpt_path=os.path.join(folder, "s3"))
    out["3>2"] = start.weights, start.average
    return out


class _SaveAt(L.Callback):
    """Saves ``folder/name`` at ``step``, then has ``_HeldAtStart`` callbacks after it read what was saved."""

    def __init__(self, step: int, folder: str, name: str) -> None:
        self.step, self.path = step, os.path.join(folder, name)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)  # (gathers the average of the masters' parts into the copy)
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, _HeldAtStart):
                    callback.on_train_start(trainer, pl_module)


def test_mixed_precision_weight_averaging_resumes_exactly_in_any_layout(tmp_path):
    """Resumed under stages 1-2 in bf16-mixed, the average was read through the module's bf16 replicas (rounded:
    4.3e-4 off the uninterrupted run's after 3 steps); and converted from stage 3, the average became the fp32
    masters, which the module's own weights, rounded to bf16, then overwrote (3.6e-4 off). Now the resumed run ends
    bit-identical in its own layout and starts from what was saved in another."""
    for r in run_on_ranks(_averaged_resumes, str(tmp_path), init_process_group=False):
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["whole"], strict=True))
        for saved, resumed in (("saved2", "2>3"), ("saved3", "3>2")):
            for kept, loaded in zip(r[saved], r[resumed], strict=True):
                assert kept and all(torch.equal(a, b) for a, b in zip(kept, loaded, strict=True)), resumed


class _ReferenceSWA(L.Callback):
    """The average ``StochasticWeightAveraging`` should hold, kept by hand at each epoch start (where it updates) from
    the fp32 masters gathered whole."""

    def __init__(self) -> None:
        self.average: list[torch.Tensor] = []
        self.count = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flats = trainer.strategy._flat_optimizers()  # type: ignore[attr-defined]
        masters = {id(p): m for o in flats for p, m in o.whole_masters()}
        now = [masters.get(id(p), p).detach().float().clone() for p in pl_module.parameters()]
        pairs = zip(self.average, now, strict=True)
        self.average = [a + (x - a) / (self.count + 1) for a, x in pairs] if self.average else now
        self.count += 1


def _swa_of_masters(rank: int) -> dict[str, Any]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (32, 33))
    torch.manual_seed(1)
    model = _model()
    swa, reference = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1), _ReferenceSWA()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), precision="bf16-mixed",
                        max_epochs=4, callbacks=[swa, reference], limit_val_batches=0, **_QUIET)  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
    held = list(model.parameters())
    return {
        "dtypes": {p.dtype for p in held},
        "updates": (int(swa.n_averaged), reference.count),  # type: ignore[arg-type]
        "gap": max((p - a).abs().max().item() for p, a in zip(held, reference.average, strict=True)),
        "bf16_share": _bf16_share(model),
    }


def test_stochastic_weight_averaging_in_mixed_precision_averages_the_fp32_masters():
    """Under stages 1-2 in bf16-mixed, Lightning's SWA averaged the module's bf16 replicas and copied the average into
    them at the end (rounded again): the module ended holding bf16 values (0.99 of them), 3.3e-4 off the average of
    the fp32 masters. Now it averages the masters and its copy into the module sets them: the module ends holding
    the fp32 average of the masters, as DDP's holds the average of its fp32 weights."""
    for r in run_on_ranks(_swa_of_masters, init_process_group=False):
        assert r["dtypes"] == {torch.float32}
        assert r["updates"] == (4, 4)  # an update at each epoch start (swa_epoch_start=1 is the first epoch)
        assert r["gap"] <= 1e-7, r["gap"]
        assert r["bf16_share"] < 0.01, r["bf16_share"]


class _WeightsOnlyAt2(L.Callback):
    """At step 2: a weights-only checkpoint, and the fp32 weights whole (``full_state_dict``: the masters)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.whole: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path, weights_only=True)
            self.whole = {k: v.clone() for k, v in full_state_dict(trainer).items()}  # (the CPU's fp32 ones alias)


def _weights_only_in_mixed_precision(rank: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (1, 2):
        saving = _WeightsOnlyAt2(os.path.join(folder, f"weights{stage}"))
        _fit(ZeroStrategy(stage=stage), "bf16-mixed", [saving])
        if rank == 0:
            path = consolidate_checkpoint(saving.path, saving.path + ".pt")
            saved = torch.load(path, weights_only=False)["state_dict"]
            out[stage] = {
                k: (saved[k].dtype, (saved[k].float() - v).abs().max().item()) for k, v in saving.whole.items()
            }
    return out


def test_a_weights_only_checkpoint_in_mixed_precision_holds_the_fp32_weights(tmp_path):
    """Stages 1-2 in bf16-mixed: the weights-only checkpoint held the bf16 replicas (2.4e-4 off the fp32 weights; the
    masters are in the optimizer states it leaves out), where DDP's holds fp32 weights. Now it holds the masters."""
    for r in run_on_ranks(_weights_only_in_mixed_precision, str(tmp_path), init_process_group=False):
        for stage, entries in r.items():
            assert entries, stage
            assert all(dtype == torch.float32 and gap == 0.0 for dtype, gap in entries.values()), (stage, entries)


def _bf16_share(module: torch.nn.Module) -> float:
    """The share of ``module``'s parameter values that bf16 holds exactly (an fp32 average rounded to bf16: 1)."""
    exact = sum(int((a == a.to(torch.bfloat16).float()).sum()) for a in module.parameters())
    return exact / sum(a.numel() for a in module.parameters())


def test_mixed_precision_stages_1_and_2_end_fit_holding_the_fp32_masters(tmp_path):
    """Through fit the trainable parameters are views into bf16 buckets; after it the module held those bf16
    replicas (its state dict, and a notebook's module, the fp32 weights rounded), where DDP and stage 3 end in fp32.
    Now the parameters are fp32 again and hold the masters, which the checkpoint holds; under ``EMAWeightAveraging``
    the fp32 average it copies in at the end of training, an average kept fp32 through the swaps around validation
    (Lightning's copies both ways rounded it to bf16 at every validation)."""
    for r in run_on_ranks(_mixed_precision_ends_fp32, str(tmp_path), init_process_group=False):
        for stage in (1, 2):
            held, reference = r[stage]
            assert {v.dtype for v in held.values()} == {torch.float32}, stage
            if reference is not None:  # rank 0
                assert held.keys() == reference.keys()
                assert [k for k in reference if not torch.equal(held[k], reference[k])] == [], stage
        assert r["ema"] and all(dtype == torch.float32 and same for dtype, same in r["ema"]), r["ema"]
        # The average is the EMA of the fp32 masters (before: of the bf16 replicas, off by up to their rounding)
        assert all(gap <= 1e-7 for gap, _ in r["ema_gap"]), r["ema_gap"]
        assert max(off for _, off in r["ema_gap"]) > 1e-5, r["ema_gap"]  # bf16 rounding: 1.9e-4
        if "ema_saved" in r:
            assert max(r["ema_saved"]) <= 1e-7, r["ema_saved"]
        assert r["ds_ema_rounded"] < 0.01, r["ds_ema_rounded"]  # of the bf16 module 0.22; Lightning's swap: 1.0
        assert all(gap <= 1e-7 for gap, _ in r["ds_ema_gap"]), r["ds_ema_gap"]
        assert max(off for _, off in r["ds_ema_gap"]) > 1e-5, r["ds_ema_gap"]
        assert r["ema_rounded"] < 0.01, r["ema_rounded"]  # 0.0; of the replicas 0.22; Lightning's swaps 0.99


class _WholeAtTrainEnd(L.Callback):
    """``full_state_dict`` in a hook every rank runs inside fit (stages 1-2 in bf16: the module holds bf16 replicas)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dtypes = {p.dtype for p in pl_module.parameters()}
        self.whole = full_state_dict(trainer)


def _whole_weights(rank: int, folder: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out: dict[str, Any] = {}
    runs = {
        "ddp": ("ddp", "32-true"),
        # Lightning's own, a user's fully_shard: its checkpoint written whole (one file) is the reference.
        "lightning_fsdp2": (ModelParallelStrategy(save_distributed_checkpoint=False), "32-true"),
        "zero1_bf16": (ZeroStrategy(stage=1), "bf16-mixed"),
        "zero3_bf16": (ZeroStrategy(stage=3), "bf16-mixed"),
        "tp2": (ZeroStrategy(stage=3, tensor_parallel=2), "32-true"),
        "pp2": (ZeroStrategy(pipeline_parallel=2), "32-true"),
        "deepspeed3_bf16": (DeepSpeedZeroStrategy(stage=3), "bf16-mixed"),
    }
    for name, (strategy, precision) in runs.items():
        inside = _WholeAtTrainEnd()
        model, trainer = _fit(strategy, precision, [inside])
        whole = full_state_dict(trainer)
        if name == "zero1_bf16":
            out["zero1_bf16_inside"] = (inside.dtypes, inside.whole)
        if name == "tp2":  # torch's own full state dict of the split module: the packed rows in the ranks' order
            naive = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            out["tp2_torch"] = naive.get("blocks.0.attn.qkv.weight")
        out[name] = (whole, _consolidated(trainer, folder, name))
    return out


def test_full_state_dict_is_the_model_as_written_under_every_layout(tmp_path):
    """Rank 0 gets every weight of the model as built, equal to the consolidated checkpoint (bf16 runs: the fp32
    masters, also inside fit where the module holds their bf16 rounding), loadable into a fresh model; the other rank
    ``{}``. Under tensor parallelism torch's own full state dict
    of the split module holds the packed q/k/v rows in the ranks' order: a model that loads, and is wrong."""
    rank0, rank1 = run_on_ranks(_whole_weights, str(tmp_path), init_process_group=False)
    for name in ("ddp", "lightning_fsdp2", "zero1_bf16", "zero3_bf16", "tp2", "pp2", "deepspeed3_bf16"):
        whole, reference = rank0[name]
        assert rank1[name][0] == {}, name
        assert whole.keys() == reference.keys() and len(whole) == 29, name
        differing = [
            k for k in reference if whole[k].dtype != reference[k].dtype or not torch.equal(whole[k], reference[k])
        ]
        assert differing == [], (name, differing)
        assert {v.device.type for v in whole.values()} == {"cpu"} and {v.dtype for v in whole.values()} == {
            torch.float32
        }
        _model().load_state_dict(whole)  # strict
    dtypes, inside = rank0["zero1_bf16_inside"]
    assert torch.bfloat16 in dtypes and inside.keys() == rank0["zero1_bf16"][0].keys()
    assert all(torch.equal(inside[k], v) for k, v in rank0["zero1_bf16"][0].items())  # the masters, not their rounding
    qkv = rank0["tp2"][0]["blocks.0.attn.qkv.weight"]
    assert rank0["tp2_torch"].shape == qkv.shape and not torch.equal(rank0["tp2_torch"], qkv)


def test_full_state_dict_names_the_way_in_without_a_module_and_under_fsdp1():
    from types import SimpleNamespace

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.raises(ValueError, match=r"full_state_dict\(trainer\)`: the trainer has no LightningModule"):
        full_state_dict(L.Trainer(accelerator="cpu", devices=1, **_QUIET))
    # Lightning's FSDPStrategy wraps submodules in FSDP1 units (which need an accelerator to be built: a bare one here).
    model = _model()
    unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(unit)
    model.blocks[0].add_module("unit", unit)
    with pytest.raises(ValueError, match=r"FSDP1 units .*state_dict_type='full'.*ZeroStrategy\(stage=3\)"):
        full_state_dict(SimpleNamespace(lightning_module=model, strategy=None, global_rank=0))


class _ClampHead(L.Callback):
    """A user's in-place write into the module after each step (weights clipped to a box), and the positions the
    module holds at zero at the last batch's end (pruned: the replicas, bf16 inside fit)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            pl_module.lm_head.weight.clamp_(-(2**-6), 2**-6)  # a bound bf16 holds exactly
        self.zeros = {n: p.detach() == 0 for n, p in pl_module.named_parameters() if p.dim() == 2}


class _SaveAfterStep2(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)


def _written_in_fit(rank: int, folder: str) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import MagnitudePruning

    clamp, path = _ClampHead(), os.path.join(folder, "step2")
    callbacks = [MagnitudePruning(0.5, plot=False), clamp, _SaveAfterStep2(path)]
    model, _ = _fit(ZeroStrategy(stage=2), "bf16-mixed", callbacks)
    saved = None
    if rank == 0:
        saved = torch.load(consolidate_checkpoint(path, path + ".pt"), weights_only=False)["state_dict"]
    return {"zeros": clamp.zeros, "after_fit": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "saved": saved}  # fmt: skip


def test_writes_into_the_module_in_fit_stand_in_the_fp32_masters(tmp_path):
    """Stages 1-2 in mixed precision: a pruning mask or a user's clamp written into the module at a batch's end landed
    in the bf16 replicas only, and the next step put the masters' rounding back over them: the pruned weights were
    back (dense) in every checkpoint (consolidated: 0% zeros where the module held 39%) and in the module after fit.
    Now the written values become the masters at the next step, and consolidation and ``full_state_dict`` take them
    where the step has not come yet."""
    rank0 = run_on_ranks(_written_in_fit, str(tmp_path), init_process_group=False)[0]
    zeros, after_fit, saved = rank0["zeros"], rank0["after_fit"], rank0["saved"]
    assert sum(int(z.sum()) for z in zeros.values()) > 0.3 * sum(z.numel() for z in zeros.values())  # pruned
    for name, zero in zeros.items():
        assert after_fit[name].dtype == torch.float32 and bool((after_fit[name][zero] == 0).all()), name
    # (A write equal to the master's bf16 rounding cannot be told from none: the master stays, within half a step.)
    assert float(after_fit["lm_head.weight"].to(torch.bfloat16).abs().max()) <= 2**-6
    # A checkpoint written after the callbacks' batch end, before the next step: its masks and clamp hold too.
    pruned = sum(int((v == 0).sum()) for k, v in saved.items() if k in zeros)
    assert pruned > 0.3 * sum(saved[k].numel() for k in zeros)
    assert float(saved["lm_head.weight"].to(torch.bfloat16).abs().max()) <= 2**-6


def _hugging_face_export(rank: int, folder: str) -> tuple[float, float] | None:
    from benchmarks.conformance import _hf_gpt2

    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (32, 33))
    torch.manual_seed(1)
    model = _hf_gpt2()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2), max_steps=3,
                        **_QUIET)  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
    held_out = DataLoader(TensorDataset(tokens[:8, :-1], tokens[:8, 1:]), batch_size=8)
    validated = trainer.validate(model, held_out, verbose=False)[0]["val_loss"]
    weights = full_state_dict(trainer)
    if rank != 0:
        return None
    hf = model.model  # the user's `self.model`: its keys without the wrapper's prefix
    hf.save_pretrained(folder, state_dict={k.removeprefix("model."): v for k, v in weights.items()})
    reloaded = type(hf).from_pretrained(folder).eval()
    with torch.no_grad():
        return validated, float(reloaded(input_ids=tokens[:8, :-1], labels=tokens[:8, :-1]).loss)


def test_a_hugging_face_model_exported_after_a_tensor_parallel_fit_reloads_computing_what_was_validated(tmp_path):
    """GPT-2 (its attention's q/k/v packed in one ``Conv1D``, the head tied to the embedding) split over 2 ranks:
    ``full_state_dict`` -> ``save_pretrained`` -> ``from_pretrained`` in one process gives the loss the split model
    validated with."""
    validated, reloaded = run_on_ranks(_hugging_face_export, str(tmp_path), init_process_group=False)[0]
    assert reloaded == pytest.approx(validated, rel=1e-6)
