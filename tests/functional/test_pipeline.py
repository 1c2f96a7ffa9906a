"""Pipeline parallelism without processes: the cut, the stand-in container, micro-batches, the bubble, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.pipeline import (
    PipelinedBlocks,
    StageInput,
    StageOutput,
    StageRun,
    bubble_fraction,
    install_pipeline_,
    plan_pipeline,
    simulated_bubble,
)
from lightning_bigtrain.models import CharGPT, FashionCNN
from lightning_bigtrain.strategies import PipelineOptions, ZeroOptions, ZeroStrategy
from lightning_bigtrain.strategies._pipeline import split_microbatches


def _gpt(layers: int = 4) -> CharGPT:
    return CharGPT(block_size=8, n_layer=layers, n_head=2, n_embd=16, dropout=0.0)


class Uneven(nn.Module):
    """Blocks of one class but unequal widths: the automatic cut balances their parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(w, w) for w in (64, 8, 8, 8, 8, 64)])


def test_the_cut_follows_the_largest_block_container_and_balances_parameters():
    plan = plan_pipeline(_gpt(4), 2)
    assert plan.container == "blocks" and plan.boundaries == (0, 2, 4)
    assert plan.blocks(1) == ("2", "3")
    uneven = plan_pipeline(Uneven(), 3)
    # 64^2 + 64 each for the wide ones; the four narrow ones together are far smaller: one stage each side.
    assert uneven.boundaries == (0, 1, 5, 6), uneven


def test_split_points_place_the_cut_and_are_checked():
    assert plan_pipeline(_gpt(4), 2, split_points=[1]).boundaries == (0, 1, 4)
    with pytest.raises(ValueError, match=r"give 1 block indices"):
        plan_pipeline(_gpt(4), 2, split_points=[1, 2])
    with pytest.raises(ValueError, match=r"must increase strictly within 1\.\.3"):
        plan_pipeline(_gpt(4), 2, split_points=[4])
    with pytest.raises(ValueError, match=r"2 blocks in `blocks` cannot fill 4 stages"):
        plan_pipeline(_gpt(2), 4)


def test_a_model_without_repeated_blocks_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"FashionCNN has no ModuleList/Sequential of two or more blocks"):
        plan_pipeline(FashionCNN(), 2)


def test_the_stand_in_runs_this_stages_blocks_and_carries_the_result_out():
    model = _gpt(4)
    reference = [b for b in model.blocks]
    plan = plan_pipeline(model, 2)
    stub = install_pipeline_(model, plan, [1])
    assert isinstance(model.blocks, PipelinedBlocks) and len(model.blocks) == 4
    assert {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("blocks.")} == {"2", "3"}
    x, received = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    # Last stage: the received activation through blocks 2 and 3, back to the step.
    stub.run = StageRun(plan.blocks(1), received, last=True, meta=(received.shape, received.dtype))
    expected = reference[3](reference[2](received))
    torch.testing.assert_close(stub(x), expected)
    # Not last: the result leaves the step by StageOutput; a probe returns the blocks' input.
    stub.run = StageRun(plan.blocks(1), None, last=False)
    with pytest.raises(StageOutput) as out:
        stub(x)
    torch.testing.assert_close(out.value.hidden, reference[3](reference[2](x)))
    stub.run = StageRun(probe=True)
    with pytest.raises(StageInput) as found:
        stub(x)
    assert found.value.hidden is x


def test_the_stand_in_refuses_what_would_compute_the_wrong_thing():
    model = _gpt(4)
    stub = install_pipeline_(model, plan_pipeline(model, 2), [0])
    with pytest.raises(RuntimeError, match=r"runs inside the strategy's training, validation and test steps"):
        stub(torch.randn(1, 8, 16))
    with pytest.raises(RuntimeError, match=r"by iterating the container"):
        model.blocks[3](torch.randn(1, 8, 16))
    assert model.blocks[3].ln1.normalized_shape == (16,)  # attributes are readable (nn.TransformerEncoder reads them)
    assert model.blocks[:4] is stub and model.blocks[0:] is stub  # every block: the stage's, as iterating
    with pytest.raises(RuntimeError, match=r"must run all of them"):
        list(model.blocks[:2])
    stub.run = StageRun(("0", "1"), None, last=True, meta=(torch.Size([1, 8, 15]), torch.float32))
    with pytest.raises(ValueError, match=r"changed the hidden state from \(1, 8, 15\)"):
        stub(torch.randn(1, 8, 16))
    stub.run = StageRun(("0", "1"), None, last=True)
    stub(torch.randn(1, 8, 16))
    with pytest.raises(RuntimeError, match=r"called twice in one step"):
        stub(torch.randn(1, 8, 16))


def test_micro_batches_cut_every_per_sample_tensor_and_keep_the_rest():
    batch = {"x": torch.arange(8).view(8, 1), "y": (torch.arange(8), "tag"), "scale": torch.tensor(2.0)}
    parts = split_microbatches(batch, 4)
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts[1]["y"][1] == "tag" and parts[3]["scale"].item() == 2.0
    with pytest.raises(ValueError, match=r"a batch of 6 cannot be cut into 4 equal micro-batches.*drop_last=True"):
        split_microbatches((torch.zeros(6, 2),), 4)


def test_bubble_formula_and_the_replay_of_measured_actions():
    assert bubble_fraction("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    # GPipe on 2 ranks, 2 micro-batches, unit forward and backward: rank 0 idles 2 of 6 units, rank 1 as much.
    gpipe = {
        0: [(0, "F", 0, 1.0), (0, "F", 1, 1.0), (0, "B", 0, 1.0), (0, "B", 1, 1.0)],
        1: [(1, "F", 0, 1.0), (1, "F", 1, 1.0), (1, "B", 0, 1.0), (1, "B", 1, 1.0)],
    }
    assert simulated_bubble(gpipe, 2) == pytest.approx(1 - 8 / (2 * 6))
    assert simulated_bubble(gpipe, 2) == pytest.approx(bubble_fraction("gpipe", 2, 2))
    with pytest.raises(ValueError, match=r"cannot be met"):
        simulated_bubble({0: [(0, "B", 0, 1.0)], 1: []}, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_parallel": 0}, r"pipeline_parallel=0\)`: must be an integer >= 1"),
        ({"pipeline_parallel": 2, "stage": 2, "offload_optimizer": True}, r"offload_params\)` is not supported yet"),
        ({"pipeline_parallel": 2, "compression": "fp16"}, r"compression\)` is not supported yet"),
        (
            {"pipeline_parallel": 2, "options": ZeroOptions(save_distributed_checkpoint=False)},
            r"save_distributed_checkpoint=False\)` is not supported yet",
        ),
        ({"pipeline": PipelineOptions()}, r"no effect without `pipeline_parallel` >= 2"),
    ],
)
def test_bad_pipeline_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "zb"}, r"schedule='zb'\)`: choose one of gpipe, 1f1b, interleaved_1f1b"),
        ({"microbatches": 0}, r"microbatches=0\)`: give an integer >= 1"),
        ({"stages_per_rank": 2}, r"several stages per rank need schedule='interleaved_1f1b'"),
        ({"schedule": "interleaved_1f1b", "stages_per_rank": 1}, r"give 2 or more"),
    ],
)
def test_bad_pipeline_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineOptions(**kwargs)


def test_defaults():
    options = PipelineOptions()
    assert options.schedule == "1f1b" and options.microbatches_for(2) == 4 and options.virtual_stages == 1
    assert PipelineOptions(schedule="interleaved_1f1b").virtual_stages == 2
    assert ZeroStrategy(pipeline_parallel=2).pipeline_options == options


def test_magnitude_pruning_refuses_a_pipeline_at_setup():
    import lightning as L

    from lightning_bigtrain.callbacks import MagnitudePruning

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(pipeline_parallel=2), logger=False)
    with pytest.raises(ValueError, match=r"cannot prune under ZeroStrategy\(pipeline_parallel=2\) yet"):
        MagnitudePruning(0.5).setup(trainer, _gpt(), "fit")


class PassesBias(nn.Module):
    """A block whose second output the step would give to the next block (T5's position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.sum(-1)


def test_blocks_that_return_more_tensors_than_the_hidden_state_are_refused():
    model = nn.Module()
    model.layers = nn.ModuleList([PassesBias(), PassesBias()])
    stub = install_pipeline_(model, plan_pipeline(model, 2), [0])
    stub.run = StageRun(("0",), None, last=False)
    with pytest.raises(ValueError, match=r"tensors beyond the hidden state \(e.g. T5's position bias"):
        stub(torch.randn(2, 4))


def test_a_refusal_inside_the_schedule_is_raised_as_itself():
    """torch's schedule wraps a stage's error in "[Stage 0] failed to run forward"; this package's refusal (the
    blocks' message) comes out as itself, other errors as torch raised them."""
    from lightning_bigtrain.strategies._pipeline import _refusals_unwrapped

    def stage_failed(cause: Exception) -> None:
        raise RuntimeError("[Stage 0] failed to run forward") from cause

    refused = r"^pipeline_parallel: `blocks`'s blocks changed"
    with pytest.raises(ValueError, match=refused) as raised, _refusals_unwrapped("blocks"):
        stage_failed(ValueError("pipeline_parallel: `blocks`'s blocks changed the hidden state"))
    assert raised.value.__cause__ is None
    with pytest.raises(RuntimeError, match=r"failed to run forward"), _refusals_unwrapped("blocks"):
        stage_failed(ValueError("mat1 and mat2 shapes cannot be multiplied"))
