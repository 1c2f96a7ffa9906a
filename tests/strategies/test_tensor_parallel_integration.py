"""Tensor parallelism under ZeroStrategy on CPU ranks over gloo: losses equal a single-process run."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import ZeroStrategy
from lightning_bigtrain.utilities import grad_norm
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class OneReplica(ShakespeareDataModule):
    """The single process's loader: the order Lightning's injected ``DistributedSampler`` (seed 0) deals to the
    data-parallel ranks, as one replica. Rank ``r`` of ``N`` takes ``perm[r::N]``, so ``N`` ranks' batches of
    ``B`` are together this loader's batch of ``N * B``."""

    def train_dataloader(self) -> DataLoader:
        data = self._splits["train"]
        return DataLoader(data, batch_size=self.batch_size, sampler=DistributedSampler(data, 1, 0, seed=0))


class Losses(L.Callback):
    """Each step's loss averaged over the data-parallel ranks (every rank of a tensor-parallel group has it)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.values.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


class GradNorms(L.Callback):
    """``grad_norm(pl_module, 2)`` before each of the first 3 optimizer steps (every parameter's key on every rank:
    split ones, and under pipeline parallelism the other stages')."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if len(self.values) < 3:
            self.values.append({k: float(v) for k, v in grad_norm(pl_module, 2).items()})


def assert_same_norms(got: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(got) == len(expected) == 3
    for step, reference in zip(got, expected, strict=True):
        assert step.keys() == reference.keys() and len(step) > 10
        for key, value in reference.items():
            assert step[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def _model() -> CharGPT:
    return CharGPT(block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0, warmup_steps=5)


def _fit(
    devices: int, strategy: Any, steps: int, batch: int, accumulate: int = 1, norms: GradNorms | None = None
) -> tuple[list[float], Any]:
    L.seed_everything(0, verbose=False)
    model = _model()
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0,
                        gradient_clip_val=0.5, enable_checkpointing=False, accumulate_grad_batches=accumulate,
                        callbacks=[losses] + ([norms] if norms is not None else []), **_QUIET)  # fmt: skip
    data = (OneReplica if devices == 1 else ShakespeareDataModule)(block_size=32, batch_size=batch, subset=2048)
    trainer.fit(model, datamodule=data)
    return losses.values, trainer.strategy


def _tp2(rank: int, steps: int) -> dict[str, Any]:
    norms = GradNorms()
    losses, strategy = _fit(2, ZeroStrategy(stage=3, tensor_parallel=2), steps, batch=8, norms=norms)
    from lightning_bigtrain.functional.tensor_parallel import sharded_fraction

    plan = strategy.tensor_parallel_plan
    return {"losses": losses, "fraction": sharded_fraction(strategy.lightning_module, plan),
            "replicated": dict(plan.replicated), "norms": norms.values}  # fmt: skip


def _single(rank: int, steps: int, batch: int, accumulate: int = 1) -> list[float]:
    return _fit(1, "auto", steps, batch, accumulate)[0]


def _single_norms(rank: int, steps: int, batch: int) -> tuple[list[float], list[dict[str, float]]]:
    norms = GradNorms()
    return _fit(1, "auto", steps, batch, norms=norms)[0], norms.values


def _assert_same(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected)
    first = max(abs(a - b) / abs(b) for a, b in zip(got[:5], expected[:5], strict=True))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected, strict=True))
    assert first < 1e-5, (first, got[:5], expected[:5])
    assert worst < 1e-4, (worst, got, expected)


def test_tp2_losses_equal_a_single_process_run_over_50_steps():
    """And ``lightning_bigtrain.utilities.grad_norm`` of the split model is the single process's, on both ranks."""
    expected, expected_norms = run_on_ranks(_single_norms, 50, 8, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_tp2, 50, init_process_group=False)
    for r in results:
        print(f"tp=2: {r['fraction']:.1%} of the transformer blocks' parameters split")
        assert r["fraction"] >= 0.8, r
        assert r["replicated"] == {}
        _assert_same(r["losses"], expected)
        assert_same_norms(r["norms"], expected_norms)
    assert results[0]["losses"] == results[1]["losses"]


def _dp2_tp2(rank: int, steps: int) -> list[float]:
    return _fit(4, ZeroStrategy(stage=3, tensor_parallel=2, min_wrap_params=1000), steps, batch=8)[0]


def test_dp2_x_tp2_on_4_ranks_losses_equal_a_single_process_run():
    """FSDP2 (ZeRO-3) across two tensor-parallel pairs (4 ranks on 2 cores: oversubscribed)."""
    expected = run_on_ranks(_single, 20, 16, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_dp2_tp2, 20, world_size=4, init_process_group=False)
    for losses in results:
        _assert_same(losses, expected)


def _launched_threads_tp2(rank: int) -> tuple[int, dict[str, torch.Tensor]]:
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    suggested = _suggested_max_num_threads(2)
    if rank == 0:  # as Lightning's launcher leaves the process it runs in (the script's, rank 0)
        os.environ["OMP_NUM_THREADS"] = str(suggested)
        torch.set_num_threads(suggested)
    else:  # a rank it started: the thread count torch starts with, on more threads than rank 0
        os.environ.pop("OMP_NUM_THREADS", None)
        torch.set_num_threads(suggested + 1)
    L.seed_everything(0, verbose=False)
    model = _model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2), max_steps=3,
                        limit_val_batches=0, enable_checkpointing=False, **_QUIET)  # fmt: skip
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=256))
    replicas = {n: p.detach().clone() for n, p in model.named_parameters() if not hasattr(p, "placements")}
    return torch.get_num_threads(), replicas


def test_every_rank_runs_on_the_launchers_thread_count_and_the_tensor_parallel_replicas_stay_identical():
    """Lightning's launcher sets the thread count of its own process only (CPU cores over processes); its DDP sets
    the other ranks' alike, its ``ModelParallelStrategy`` did not. Every rank but 0 then ran on all cores (the
    cores oversubscribed), and the norms both ranks of a tensor-parallel pair compute on the same input got other
    bits from their other thread counts: those replicas drifted apart from the first step."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    (threads0, replicas0), (threads1, replicas1) = run_on_ranks(_launched_threads_tp2, init_process_group=False)
    assert threads0 == threads1 == _suggested_max_num_threads(2)
    assert replicas0.keys() == replicas1.keys() and len(replicas0) >= 10  # the norms and the position embedding
    differing = [n for n in replicas0 if not torch.equal(replicas0[n], replicas1[n])]
    assert differing == []


def _dp2_tp2_stages(rank: int, steps: int) -> dict[int, tuple[list[float], int]]:
    out = {}
    for stage in (1, 2, 3):
        losses, strategy = _fit(4, ZeroStrategy(stage=stage, tensor_parallel=2, min_wrap_params=1000), steps, batch=8,
                                accumulate=2)  # fmt: skip
        out[stage] = (losses, strategy.comm_bytes)
    return out


def test_zero_stages_1_and_2_across_tensor_parallel_pairs_equal_one_process_and_keep_their_traffic():
    """Stages 1 and 2 on the data axis (FSDP2, parameters gathered through the step): two batches accumulated per
    optimizer step. Stage 1 reduce-scatters once per optimizer step, stage 2 every batch, stage 3 also gathers the
    parameters again for every forward and backward: per optimizer step 2 : 3 : 6 messages of the same size."""
    expected = run_on_ranks(_single, 8, 16, 2, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_dp2_tp2_stages, 8, world_size=4, init_process_group=False)
    for r in results:
        for stage in (1, 2, 3):
            _assert_same(r[stage][0], expected)
        one, two, three = (r[stage][1] for stage in (1, 2, 3))
        print(f"dp=2 x tp=2, bytes sent per rank over 8 optimizer steps: stage 1 {one}, 2 {two}, 3 {three}")
        assert one / two == pytest.approx(2 / 3, rel=1e-3), (one, two)
        assert three / two == pytest.approx(2, rel=1e-3), (three, two)
    # The planner's rows (no accumulation: one gather and one reduce-scatter per optimizer step at stages 1-2, what
    # stage 1 sends per step whatever the accumulation) on the data axis, without the tensor-parallel collectives.
    from lightning_bigtrain.planning import plan
    from lightning_bigtrain.planning.parallel import estimate_tensor_parallel

    example = torch.zeros(8, 32, dtype=torch.long)
    rows = plan(_model(), devices=4, batch_shape=tuple(example.shape), accelerator="cpu", compression=False)
    tp = estimate_tensor_parallel(_model(), 2, 4, example).tensor_parallel_bytes(4)
    for stage in (1, 2):
        assert rows[f"zero{stage}_tp2"].comm_bytes_per_step - tp == pytest.approx(results[0][1][1] / 8, rel=1e-9)
    assert rows["zero1_tp2"].model_states_bytes == rows["zero3_tp2"].model_states_bytes
    assert rows["zero1_tp2"].peak_bytes > rows["zero2_tp2"].peak_bytes > rows["zero3_tp2"].peak_bytes


def _resume(rank: int, folder: str, tp: int = 2, pp: int = 1) -> dict[str, list[float]]:
    """12 steps with a checkpoint every 6 (mid-epoch); then a new Trainer resumes from step 6's (also used by the
    pipeline tests: ``pp``)."""

    def run(callbacks: list[L.Callback], ckpt_path: str | None) -> list[float]:
        L.seed_everything(0, verbose=False)  # the sampler's shuffling seed must match (checked on resume)
        losses = Losses()
        strategy = ZeroStrategy(stage=3, tensor_parallel=tp, pipeline_parallel=pp)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=12, limit_val_batches=0,
                            gradient_clip_val=0.5, callbacks=[losses, *callbacks], **_QUIET)  # fmt: skip
        data = ShakespeareDataModule(block_size=32, batch_size=8, subset=2048)
        trainer.fit(_model(), datamodule=data, ckpt_path=ckpt_path)
        return losses.values

    every6 = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=6, save_top_k=-1)
    straight = run([every6], None)
    return {"straight": straight[6:], "resumed": run([], f"{folder}/step=6.ckpt")}


def test_tp2_resumes_exactly_from_a_sharded_checkpoint(tmp_path):
    for r in run_on_ranks(_resume, str(tmp_path), init_process_group=False):
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])


def _other_layout(rank: int, folder: str) -> dict[str, list[float]]:
    """Trained at tp=2 (batch 8 on one replica), resumed from step 6 at ZeRO-3 over 2 data-parallel ranks (batch 4
    each: the same global batches). The optimizer's moments of the packed q/k/v matter from step 7 on."""
    straight = _resume(rank, folder)["straight"]
    L.seed_everything(0, verbose=False)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, min_wrap_params=1000),
                        max_steps=12, limit_val_batches=0, gradient_clip_val=0.5, callbacks=[losses],
                        **_QUIET)  # fmt: skip
    data = ShakespeareDataModule(block_size=32, batch_size=4, subset=2048)
    trainer.fit(_model(), datamodule=data, ckpt_path=f"{folder}/step=6.ckpt")
    return {"straight": straight, "resumed": losses.values}


def test_a_tp2_checkpoint_resumes_at_another_layout_and_consolidates_for_one_device(tmp_path):
    from lightning_bigtrain.strategies.zero import consolidate_checkpoint

    for r in run_on_ranks(_other_layout, str(tmp_path), init_process_group=False):
        # Another reduction order (data-parallel halves instead of tensor-parallel halves): round-off only.
        torch.testing.assert_close(r["resumed"], r["straight"], rtol=1e-5, atol=0)
    # One device, plain Lightning: the consolidated step-6 weights give step 6's loss on its batch.
    single = consolidate_checkpoint(tmp_path / "step=6.ckpt", tmp_path / "one.ckpt")
    _assert_step6_loss_on_one_device(CharGPT.load_from_checkpoint(single), r["straight"][0])


def _assert_step6_loss_on_one_device(model: CharGPT, expected: float) -> None:
    """The loss of ``model`` (the step-6 weights, whole, one process) on the batch the run's step 6 trained on."""
    L.seed_everything(0, verbose=False)
    data = OneReplica(block_size=32, batch_size=8, subset=2048)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    for _ in range(6):
        next(batches)
    with torch.no_grad():
        loss = model._loss(next(batches)).item()
    assert abs(loss - expected) / expected < 1e-5, (loss, expected)


class InOrder(L.LightningDataModule):
    """A datamodule's training split in order (no sampler injected: ``use_distributed_sampler=False``): with one
    data-parallel replica, every layout sees the same batches."""

    def __init__(self, inner: L.LightningDataModule, batch_size: int) -> None:
        super().__init__()
        self.inner, self.batch_size = inner, batch_size

    def setup(self, stage: str) -> None:
        self.inner.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.inner._splits["train"], batch_size=self.batch_size, shuffle=False)


def _no_dropout(model: L.LightningModule) -> L.LightningModule:
    """Dropout off: a split region draws its masks for its own heads, so random streams cannot match one process."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def _family_losses(rank: int, family: str, devices: int) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data
    from lightning_bigtrain.functional.tensor_parallel import sharded_fraction

    L.seed_everything(0, verbose=False)
    model = _no_dropout(_build(FAMILIES[family], 0))
    losses = Losses()
    strategy = ZeroStrategy(stage=3, tensor_parallel=2) if devices == 2 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=6, limit_val_batches=0,
                        gradient_clip_val=1.0, enable_checkpointing=False, use_distributed_sampler=False,
                        callbacks=[losses], **_QUIET)  # fmt: skip
    tied_before = _tied_names(model)
    trainer.fit(model, datamodule=InOrder(_data(FAMILIES[family].data), batch_size=8))
    plan = getattr(trainer.strategy, "tensor_parallel_plan", None)
    fraction = sharded_fraction(model, plan) if plan is not None else None
    return {"losses": losses.values, "fraction": fraction, "replicated": plan.replicated if plan else None,
            "tied": (tied_before, _tied_names(model))}  # fmt: skip


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The groups of parameter names that share one tensor (an LM head and its embedding, BERT's decoder bias)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize(
    "family", ["hf_gpt2", "hf_llama", "hf_bert", "hf_t5", "lightning_demo_transformer", "tv_vit", "timm_vit"]
)
def test_models_we_did_not_write_split_and_train_as_on_one_process(family):
    """Hugging Face GPT-2 (Conv1D, LM head tied to the embedding), Llama (no head-count attribute: heads from
    `head_dim`; grouped-query key/value projections; rotary angles given to each layer), BERT (its attention's
    output projection in a sibling module), T5 (decoder blocks with a cross-attention its encoder blocks lack, the
    relative position bias split by heads), Lightning's demo Transformer, torchvision's ViT (nn.MultiheadAttention's
    packed in_proj) and timm's ViT (its `attn_dim` divided): >= 80% of the blocks' parameters split, losses as one
    process."""
    pytest.importorskip("transformers")
    expected = run_on_ranks(_family_losses, family, 1, world_size=1, init_process_group=False)[0]["losses"]
    for r in run_on_ranks(_family_losses, family, 2, init_process_group=False):
        print(f"{family}: {r['fraction']:.1%} of the transformer blocks' parameters split")
        assert r["fraction"] >= 0.8 and r["replicated"] == {}, r
        torch.testing.assert_close(r["losses"], expected, rtol=1e-5, atol=0)
        before, after = r["tied"]
        assert after == before, f"ties broken by the split: {before} -> {after}"


def _family_checkpoint(rank: int, folder: str, family: str) -> dict[str, list[float]]:
    from benchmarks.conformance import FAMILIES, _build, _data

    L.seed_everything(0, verbose=False)
    model = _no_dropout(_build(FAMILIES[family], 0))
    losses = Losses()
    every2 = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2), max_steps=4,
                        limit_val_batches=0, use_distributed_sampler=False, callbacks=[losses, every2],
                        **_QUIET)  # fmt: skip
    trainer.fit(model, datamodule=InOrder(_data("text"), batch_size=8))
    # The same checkpoint resumed without tensor parallelism: ZeRO-3 over the 2 ranks, each on the same batches
    # (no sampler), so the average gradient is the one-batch gradient.
    L.seed_everything(0, verbose=False)
    resumed = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, min_wrap_params=1000), max_steps=4,
                        limit_val_batches=0, use_distributed_sampler=False, callbacks=[resumed], **_QUIET)  # fmt: skip
    model = _no_dropout(_build(FAMILIES[family], 1))
    trainer.fit(model, datamodule=InOrder(_data("text"), batch_size=8), ckpt_path=f"{folder}/step=2.ckpt")
    return {"tp2": losses.values, "zero3_from_step2": resumed.values}


@pytest.mark.parametrize("family", ["lightning_demo_transformer", "hf_llama", "hf_t5"])
def test_a_tp2_checkpoint_is_the_users_module(family, tmp_path):
    """The demo Transformer's nn.MultiheadAttention is split as HeadedAttention and saved as torch's packed in_proj;
    Llama's grouped-query projections are split by their own heads. Either checkpoint resumes without tensor
    parallelism (ZeRO-3, the optimizer's moments included), and consolidates to a file that loads strictly into the
    module as written and gives step 2's loss on step 2's batch."""
    from benchmarks.conformance import FAMILIES, _build, _data
    from lightning_bigtrain.strategies.zero import consolidate_checkpoint

    pytest.importorskip("transformers")

    r = run_on_ranks(_family_checkpoint, str(tmp_path), family, init_process_group=False)[0]
    losses = r["tp2"]
    # Saved as torch's packed in_proj (weights and AdamW's moments): the module as written resumes from it.
    torch.testing.assert_close(r["zero3_from_step2"], losses[2:], rtol=1e-5, atol=0)
    single = torch.load(consolidate_checkpoint(tmp_path / "step=2.ckpt", tmp_path / "one.ckpt"), weights_only=False)
    model = _build(FAMILIES[family], 1)
    model.load_state_dict(single["state_dict"], strict=True)
    model.eval()
    data = InOrder(_data("text"), batch_size=8)
    data.setup("fit")
    batch = list(data.train_dataloader())[2]
    with torch.no_grad():
        loss = model.training_step(batch, 2)
    loss = float(loss["loss"] if isinstance(loss, dict) else loss)
    assert abs(loss - losses[2]) / losses[2] < 1e-5, (loss, losses[2])


def _composed(rank: int) -> dict[str, Any]:
    import lightning_bigtrain as bt

    out = {}
    for name, extra in (("bf16-mixed", {"precision": "bf16-mixed"}),
                        ("BF16Precision", {"plugins": [bt.plugins.BF16Precision("kahan")]})):  # fmt: skip
        L.seed_everything(0, verbose=False)
        losses = Losses()
        strategy = ZeroStrategy(stage=3, tensor_parallel=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, limit_val_batches=0,
                            enable_checkpointing=False, callbacks=[losses], **_QUIET, **extra)  # fmt: skip
        trainer.fit(_model(), datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=512))
        out[name] = {"losses": losses.values, "replicated": trainer.strategy.tensor_parallel_plan.replicated}
    return out


def test_tp2_composes_with_bf16_mixed_and_pure_bf16():
    """A 16-bit block is verified in fp32 (its own round-off would fail the check): still split."""
    for r in run_on_ranks(_composed, init_process_group=False):
        for name, v in r.items():
            assert v["replicated"] == {}, name
            assert len(v["losses"]) == 4 and v["losses"][-1] < v["losses"][0], (name, v["losses"])


class SplitsItself(CharGPT):
    """A user's model that splits its MLPs itself in ``configure_model`` (the strategy must not split it again)."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.blocks:
            parallelize_module(block.mlp, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(),
                                                                                 "2": RowwiseParallel()})  # fmt: skip


def _own_split_and_nothing_to_split(rank: int) -> dict[str, Any]:
    from lightning_bigtrain.data import FashionMNISTDataModule
    from lightning_bigtrain.models import FashionCNN

    out: dict[str, Any] = {}
    L.seed_everything(0, verbose=False)
    model = SplitsItself(block_size=32, n_layer=2, n_head=4, n_embd=64)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2), max_steps=2,
                        limit_val_batches=0, enable_checkpointing=False, **_QUIET)  # fmt: skip
    trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=256))
    out["own_plan"] = trainer.strategy.tensor_parallel_plan
    out["qkv_split"] = hasattr(model.blocks[0].attn.qkv.weight, "placements")
    out["mlp_split"] = hasattr(model.blocks[0].mlp[0].weight, "placements")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, tensor_parallel=2),
                        max_steps=1, limit_val_batches=0, enable_checkpointing=False, **_QUIET)  # fmt: skip
    try:
        trainer.fit(FashionCNN(), datamodule=FashionMNISTDataModule(batch_size=16, subset=64))
    except ValueError as error:
        out["refused"], out["steps"] = str(error), trainer.global_step
    return out


def test_a_users_own_split_is_respected_and_a_model_with_nothing_to_split_is_refused_at_setup():
    """Every rank refuses the CNN at setup, before a step, naming the argument and the fix."""
    results = run_on_ranks(_own_split_and_nothing_to_split, init_process_group=False)
    for r in results:
        assert r["own_plan"] is None and r["mlp_split"] and not r["qkv_split"]
        assert r.get("steps") == 0 and "`ZeroStrategy(tensor_parallel=2)` cannot split FashionCNN" in r["refused"], r
        assert "Use tensor_parallel=1" in r["refused"]
