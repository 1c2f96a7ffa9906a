"""Sequence parallelism (with tensor parallelism) under ZeroStrategy on CPU ranks over gloo: the losses of one process,
and less saved for backward per rank."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch

from lightning_bigtrain.data import ShakespeareDataModule
from lightning_bigtrain.strategies import ZeroStrategy
from tests.helpers.distributed import run_on_ranks
from tests.strategies.test_tensor_parallel_integration import (
    _QUIET,
    InOrder,
    Losses,
    OneReplica,
    _assert_same,
    _model,
    _no_dropout,
)

pytestmark = pytest.mark.integration


class SavedBytes(L.Callback):
    """Bytes this rank saves for backward in the second training step (each saved tensor's local part)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != 1:
            return

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = getattr(t, "_local_tensor", t)
            self.bytes += local.numel() * local.element_size()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None


class SentBytes(L.Callback):
    """Ring-equivalent bytes this rank sends in the tensor-parallel collectives of the second training step."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self._context: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1 and trainer.world_size > 1:
            from benchmarks.parallel import count_tensor_parallel_bytes

            self._context = count_tensor_parallel_bytes(2)
            self._counted = self._context.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self.bytes, self._context = self._counted["bytes"], None


def _char_gpt(rank: int, devices: int, sequence: bool, steps: int, batch: int = 8) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    losses, saved, sent = Losses(), SavedBytes(), SentBytes()
    strategy = ZeroStrategy(tensor_parallel=2, sequence_parallel=sequence) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0,
                        gradient_clip_val=0.5, enable_checkpointing=False, callbacks=[losses, saved, sent],
                        **_QUIET)  # fmt: skip
    data = (OneReplica if devices == 1 else ShakespeareDataModule)(block_size=32, batch_size=batch, subset=2048)
    trainer.fit(_model(), datamodule=data)
    plan = getattr(trainer.strategy, "tensor_parallel_plan", None)
    planned = planned_sent = None
    if devices == 2:
        from lightning_bigtrain.planning.parallel import estimate_tensor_parallel

        example = torch.zeros(batch, 32, dtype=torch.long)
        est = estimate_tensor_parallel(_model(), 2, 2, example)
        planned = est.activations(example, sequence_parallel=sequence)[0]
        planned_sent = est.tensor_parallel_bytes(4, sequence_parallel=sequence)
    return {"losses": losses.values, "saved": saved.bytes, "dim": plan.sequence_dim if plan else None,
            "norms": len(plan.norms) if plan else 0, "refused": plan.sequence_refused if plan else None,
            "planned": planned, "sent": sent.bytes, "planned_sent": planned_sent}  # fmt: skip


def test_sequence_parallel_equals_one_process_and_saves_less_for_backward():
    """CharGPT (2 blocks, each with 2 LayerNorms) at tp=2: with sequence parallelism the losses are one process's
    over 20 steps (clipping on), and each rank saves less for backward than under tensor parallelism alone (the
    norms' and residuals' activations are split)."""
    expected = run_on_ranks(_char_gpt, 1, False, 20, world_size=1, init_process_group=False)[0]
    results = run_on_ranks(_char_gpt, 2, True, 20, init_process_group=False)
    plain = run_on_ranks(_char_gpt, 2, False, 2, init_process_group=False)
    for r, p in zip(results, plain, strict=True):
        assert r["refused"] is None and r["dim"] == 1 and r["norms"] == 4, r
        _assert_same(r["losses"], expected["losses"])
        print(f"saved for backward per rank, step 2: tp=2 {p['saved']} (planner {p['planned']:.0f}), "
              f"tp=2 + sequence parallel {r['saved']} (planner {r['planned']:.0f})")  # fmt: skip
        assert r["saved"] < p["saved"], (r["saved"], p["saved"])
        assert r["planned"] < p["planned"], (r["planned"], p["planned"])
        # Bytes sent in the tensor-parallel collectives of one step: the planner's count, exactly, for both.
        print(f"tensor-parallel bytes sent per rank, step 2: tp=2 {p['sent']:.0f} (planner {p['planned_sent']:.0f}), "
              f"tp=2 + sequence parallel {r['sent']:.0f} (planner {r['planned_sent']:.0f})")  # fmt: skip
        assert p["sent"] == p["planned_sent"] and r["sent"] == r["planned_sent"]


def test_sequence_parallel_with_zero3_across_two_pairs():
    """dp=2 x tp=2 on 4 ranks (oversubscribed): the norms' replicated parameters sharded by FSDP2 across the pairs."""
    expected = run_on_ranks(_char_gpt, 1, False, 10, 16, world_size=1, init_process_group=False)[0]
    for r in run_on_ranks(_char_gpt, 4, True, 10, world_size=4, init_process_group=False):
        assert r["dim"] == 1, r
        _assert_same(r["losses"], expected["losses"])


def _family(rank: int, family: str, devices: int) -> dict[str, Any]:
    from benchmarks.conformance import FAMILIES, _build, _data

    L.seed_everything(0, verbose=False)
    model = _no_dropout(_build(FAMILIES[family], 0))
    losses = Losses()
    strategy = ZeroStrategy(tensor_parallel=2, sequence_parallel=True) if devices == 2 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=6, limit_val_batches=0,
                        gradient_clip_val=1.0, enable_checkpointing=False, use_distributed_sampler=False,
                        callbacks=[losses], **_QUIET)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=InOrder(_data(FAMILIES[family].data), batch_size=8))
    plan = getattr(trainer.strategy, "tensor_parallel_plan", None)
    warned = [str(w.message) for w in caught if "runs without sequence parallelism" in str(w.message)]
    return {"losses": losses.values, "dim": plan.sequence_dim if plan else None,
            "refused": plan.sequence_refused if plan else None, "warned": warned}  # fmt: skip


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama", "tv_vit", "lightning_demo_transformer"])
def test_models_we_did_not_write_under_sequence_parallel(family):
    """Hugging Face GPT-2 and Llama (its rotary angles arrive whole, as the model computes them outside the blocks)
    and torchvision's ViT run sequence-parallel with one process's losses; Lightning's demo
    Transformer (its decoder layers take the encoder's memory as a second input) is refused, named in the plan, and
    trains as under tensor parallelism alone."""
    pytest.importorskip("transformers")
    expected = run_on_ranks(_family, family, 1, world_size=1, init_process_group=False)[0]["losses"]
    results = run_on_ranks(_family, family, 2, init_process_group=False)
    for r in results:
        if family == "lightning_demo_transformer":
            assert r["dim"] is None and "second input" in r["refused"], r
        else:
            assert r["dim"] == 1 and r["refused"] is None and not r["warned"], r
        torch.testing.assert_close(r["losses"], expected, rtol=1e-5, atol=0)
    if family == "lightning_demo_transformer":  # the refusal is said (on global rank 0), with its reason
        assert results[0]["warned"] and "second input" in results[0]["warned"][0], results[0]


def test_bad_sequence_parallel_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"needs `tensor_parallel` >= 2"):
        ZeroStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True, pipeline_parallel=2\)` is not supported yet"):
        ZeroStrategy(tensor_parallel=2, sequence_parallel=True, pipeline_parallel=2)
    with pytest.raises(TypeError, match=r"sequence_parallel='yes'"):
        ZeroStrategy(tensor_parallel=2, sequence_parallel="yes")  # type: ignore[arg-type]
