"""Pipeline parallelism under ZeroStrategy on CPU ranks over gloo: losses equal a single-process run."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.strategies import PipelineOptions, ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.strategies.test_tensor_parallel_integration import (
    _QUIET,
    GradNorms,
    InOrder,
    Losses,
    OneReplica,
    _assert_same,
    _assert_step6_loss_on_one_device,
    _no_dropout,
    _resume,
    assert_same_norms,
)

pytestmark = pytest.mark.integration


def _model() -> CharGPT:
    return CharGPT(block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.0, warmup_steps=5)


class Logged(L.Callback):
    """What rank 0's LightningModule logged (the last stage computed it: replayed on every rank)."""

    def __init__(self) -> None:
        self.train: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.train.append(float(trainer.callback_metrics["train_loss"]))


def _fit(
    devices: int,
    strategy: Any,
    steps: int,
    accumulate: int = 1,
    batch: int = 8,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: str | None = None,
) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    losses, logged, norms = Losses(), Logged(), GradNorms()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=2,
                        val_check_interval=steps * accumulate, gradient_clip_val=0.5,
                        enable_checkpointing=bool(callbacks), accumulate_grad_batches=accumulate,
                        callbacks=[losses, logged, norms, *callbacks],
                        **_QUIET)  # fmt: skip
    data = (OneReplica if devices == 1 else ShakespeareDataModule)(block_size=32, batch_size=batch, subset=2048)
    trainer.fit(_model(), datamodule=data, ckpt_path=ckpt_path)
    bubble = getattr(trainer.strategy, "pipeline_bubble", None)
    return {"losses": losses.values, "logged": logged.train, "val": float(trainer.callback_metrics["val_loss"]),
            "bubble": bubble, "norms": norms.values}  # fmt: skip


def _single(rank: int, steps: int, accumulate: int = 1, batch: int = 8) -> dict[str, Any]:
    return _fit(1, "auto", steps, accumulate, batch)


def _pp2(rank: int, schedule: str, steps: int, accumulate: int = 1) -> dict[str, Any]:
    return _fit(2, ZeroStrategy(pipeline_parallel=2, pipeline=PipelineOptions(schedule=schedule)), steps, accumulate)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_losses_equal_a_single_process_run_over_50_steps(schedule):
    """4 micro-batches of 2 through 2 stages; clipping by the norm over both; the logged loss and the validation
    loss (computed on the last stage) reach rank 0; ``grad_norm`` gives every stage's norms on both ranks."""
    expected = run_on_ranks(_single, 50, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_pp2, schedule, 50, init_process_group=False)
    for r in results:
        _assert_same(r["losses"], expected["losses"])
        _assert_same(r["logged"], expected["logged"])
        assert abs(r["val"] - expected["val"]) / expected["val"] < 1e-4, (r["val"], expected["val"])
        assert 0.0 < r["bubble"] < 1.0, r["bubble"]
        assert_same_norms(r["norms"], expected["norms"])
    assert results[0]["losses"] == results[1]["losses"]


def test_interleaved_1f1b_with_gradient_accumulation_equals_a_single_process_run():
    """Two stages per rank (4 in all); two batches accumulated per optimizer step."""
    expected = run_on_ranks(_single, 10, 2, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_pp2, "interleaved_1f1b", 10, 2, init_process_group=False):
        _assert_same(r["losses"], expected["losses"])


def _pp2_tp2(rank: int, steps: int, folder: str) -> dict[str, Any]:
    every = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=steps // 2, save_top_k=-1)
    straight = _fit(4, ZeroStrategy(pipeline_parallel=2, tensor_parallel=2), steps, callbacks=(every,))
    resumed = _fit(4, ZeroStrategy(pipeline_parallel=2, tensor_parallel=2), steps,
                   ckpt_path=f"{folder}/step={steps // 2}.ckpt")  # fmt: skip
    return {**straight, "resumed": resumed["losses"]}


def test_pp2_x_tp2_on_4_ranks_losses_equal_a_single_process_run_and_resume_exactly(tmp_path):
    """Each stage's blocks (and the vocabulary) split over a tensor-parallel pair; 4 ranks on 2 cores (oversubscribed).
    Clipping by the norm over both axes; the replicated embeddings' split gradients summed over the pipeline. The
    mid-run checkpoint (packed q/k/v saved in their own order by each stage's ranks) resumes bit-identically."""
    expected = run_on_ranks(_single, 20, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_pp2_tp2, 20, str(tmp_path), world_size=4, init_process_group=False):
        _assert_same(r["losses"], expected["losses"])
        assert_same_norms(r["norms"], expected["norms"])
        assert abs(r["val"] - expected["val"]) / expected["val"] < 1e-4, (r["val"], expected["val"])
        assert r["resumed"] == r["losses"][10:], (r["resumed"], r["losses"][10:])


def _dp2_pp2(rank: int, steps: int) -> dict[str, Any]:
    return _fit(4, ZeroStrategy(pipeline_parallel=2), steps, batch=8)


def test_dp2_x_pp2_on_4_ranks_losses_equal_a_single_process_run():
    """Two pipelines, each stage's blocks ZeRO-3 sharded (FSDP2) across them; 4 ranks on 2 cores (oversubscribed).
    The single process trains on both pipelines' batches at once."""
    expected = run_on_ranks(_single, 20, 1, 16, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_dp2_pp2, 20, world_size=4, init_process_group=False):
        _assert_same(r["losses"], expected["losses"])


def _dp2_pp2_stages(rank: int, steps: int) -> dict[int, dict[str, Any]]:
    out = {}
    for stage in (1, 2):
        strategy = ZeroStrategy(stage=stage, pipeline_parallel=2)
        out[stage] = {**_fit(4, strategy, steps, accumulate=2), "sharded": strategy._fsdp_comm.bytes}
    return out


def test_zero_stages_1_and_2_across_pipelines_equal_one_process_and_reduce_once_per_step():
    """Each stage's blocks on FSDP2 across the two pipelines, gathered through the step; two batches of 4
    micro-batches accumulated per optimizer step. Stage 1 reduce-scatters once per optimizer step (one gather, one
    reduce-scatter), stage 2 after each of the 8 micro-batches' backwards (one gather, 8 reduce-scatters). The counts
    fail without the per-stage control of the runner (stage 1 would reduce-scatter 8 times, both gather 8 times)."""
    expected = run_on_ranks(_single, 6, 2, 16, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_dp2_pp2_stages, 6, world_size=4, init_process_group=False):
        for stage in (1, 2):
            _assert_same(r[stage]["losses"], expected["losses"])
        one, two = r[1]["sharded"], r[2]["sharded"]
        print(f"dp=2 x pp=2, FSDP2 bytes per rank over 6 optimizer steps: stage 1 {one}, stage 2 {two}")
        # 6 optimizer steps, then the validation at the end gathers each block once more: (6*2 + 1) : (6*9 + 1) units.
        assert one / two == pytest.approx(13 / 55, rel=1e-3), (one, two)
    # The planner's rows per optimizer step without accumulation (one gather and one reduce-scatter at stage 1; one
    # gather and 4 reduce-scatters at stage 2), less the pipeline's own messages and all-reduces: the measured units.
    from lightning_bigtrain.planning import plan
    from lightning_bigtrain.planning.parallel import estimate_pipeline

    example = torch.zeros(8, 32, dtype=torch.long)
    rows = plan(_model(), devices=4, batch_shape=tuple(example.shape), accelerator="cpu", compression=False)
    est = estimate_pipeline(_model(), 2, 4, example)
    other = est.pipeline_bytes(0) + est.reduce_bytes(4)
    assert rows["zero1_pp2"].comm_bytes_per_step - other == pytest.approx(one * 2 / 13, rel=1e-9)
    assert rows["zero2_pp2"].comm_bytes_per_step - other == pytest.approx(two * 5 / 55, rel=1e-9)


def _families(rank: int, devices: int) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data

    out = {}
    for family in ("hf_gpt2", "hf_llama", "lightning_demo_transformer", "tv_vit"):
        L.seed_everything(0, verbose=False)
        model = _no_dropout(_build(FAMILIES[family], 0))
        losses = Losses()
        strategy = ZeroStrategy(pipeline_parallel=2) if devices == 2 else "auto"
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=6, limit_val_batches=0,
                            gradient_clip_val=1.0, enable_checkpointing=False, use_distributed_sampler=False,
                            callbacks=[losses], **_QUIET)  # fmt: skip
        trainer.fit(model, datamodule=InOrder(_data(FAMILIES[family].data), batch_size=8))
        plan = getattr(trainer.strategy, "pipeline_plan", None)
        out[family] = {"losses": losses.values, "plan": plan}
    return out


def test_models_we_did_not_write_run_as_on_one_process_under_pp2():
    """Hugging Face GPT-2 (tied LM head: its gradient is summed from both stages), Hugging Face Llama (rotary position
    embeddings given to every block, `layers[:n]` iterated), Lightning's demo Transformer (the decoder's layers cut;
    the encoder whole on both stages, named in a warning), torchvision's ViT."""
    pytest.importorskip("transformers")
    expected = run_on_ranks(_families, 1, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_families, 2, init_process_group=False):
        for family, got in r.items():
            plan = got["plan"]
            print(f"{family}: `{plan.container}` cut at {plan.boundaries}; whole on every stage: {plan.others}")
            assert plan.stages == 2
            torch.testing.assert_close(got["losses"], expected[family]["losses"], rtol=1e-5, atol=0)
        assert r["lightning_demo_transformer"]["plan"].others == ("model.transformer.encoder.layers",)


def test_pp2_resumes_exactly_and_its_checkpoint_loads_whole_on_one_device(tmp_path):
    from lightning_bigtrain.strategies.zero import consolidate_checkpoint

    for r in run_on_ranks(_resume, str(tmp_path), 1, 2, init_process_group=False):  # tp=1, pp=2 (a block a stage)
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
    # Another layout: the whole model on one process, plain Lightning, from the consolidated step-6 file.
    model = CharGPT.load_from_checkpoint(consolidate_checkpoint(tmp_path / "step=6.ckpt", tmp_path / "one.ckpt"))
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    _assert_step6_loss_on_one_device(model, r["straight"][0])


def _composed(rank: int) -> dict[str, Any]:
    import lightning_bigtrain as bt

    L.seed_everything(0, verbose=False)
    teacher = CharGPT(block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(pipeline_parallel=2), max_steps=3,
                        precision="bf16-mixed", limit_val_batches=2, enable_checkpointing=False,
                        callbacks=[losses, bt.callbacks.KnowledgeDistillation(teacher), bt.callbacks.OperatorFusion()],
                        **_QUIET)  # fmt: skip
    data = ShakespeareDataModule(block_size=32, batch_size=8, subset=2048)
    trainer.fit(_model(), datamodule=data)
    logged = sorted(trainer.callback_metrics)
    trainer.validate(trainer.lightning_module, datamodule=data, verbose=False)  # the same Trainer and (cut) module
    return {"losses": losses.values, "logged": logged, "val": float(trainer.callback_metrics["val_loss"])}


def test_pp2_composes_with_bf16_mixed_distillation_and_fusion():
    """The teacher runs whole on every stage (the last stage's loss uses it); OperatorFusion's swaps and fused loss
    run inside the stages; bf16 autocast around the schedule. Then `validate` with the same Trainer."""
    for r in run_on_ranks(_composed, init_process_group=False):
        assert len(r["losses"]) == 3 and all(torch.isfinite(torch.tensor(r["losses"]))), r
        assert any(name.startswith("distill") for name in r["logged"]), r["logged"]
        assert 0.0 < r["val"] < 10.0, r["val"]


def _refused(rank: int, family: str, devices: int) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data

    L.seed_everything(0, verbose=False)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=ZeroStrategy(pipeline_parallel=2), max_steps=2,
                        limit_val_batches=0, enable_checkpointing=False, callbacks=[losses], **_QUIET)  # fmt: skip
    try:
        trainer.fit(_build(FAMILIES[family], 0), datamodule=_data(FAMILIES[family].data))
    except (ValueError, TypeError) as error:
        return {"error": f"{type(error).__name__}: {error}", "steps": trainer.global_step, "losses": losses.values}
    return {"error": None}


@pytest.mark.parametrize(("family", "devices", "reason"), [
    ("tv_resnet18", 2, "changed the hidden state"),
    ("hf_t5", 2, "tensors beyond the hidden state"),
])  # fmt: skip
def test_a_model_whose_blocks_cannot_be_pipelined_is_refused_before_any_step(family, devices, reason):
    """A CNN (its blocks change the shape) and T5 (its blocks pass the position bias on) are refused at the first batch,
    before any optimizer step, on every rank with this package's message: a probe of each stage's blocks before the
    schedule runs (across several pipelines the refusal comes from the schedule's first forward instead, unwrapped
    from torch's "[Stage 0] failed to run forward", on the ranks whose blocks cause it)."""
    pytest.importorskip("transformers")
    for r in run_on_ranks(_refused, family, devices, world_size=devices, init_process_group=False):
        assert r["error"] is not None and r["steps"] == 0 and not r["losses"], r
        assert r["error"].startswith("ValueError: pipeline_parallel:") and reason in r["error"], r
