"""Compressors: messages, byte formulas, and compressed vs dense averaging on 2 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_bigtrain.engines.compression import GradientCompression
from lightning_bigtrain.functional.compression import (
    Cast,
    OneBit,
    PowerSGD,
    Quantize,
    TopK,
    _pack_bits,
    _topk_index,
    _unpack_bits,
    allreduce_bytes,
    reducescatter_bytes,
)
from tests.helpers.distributed import run_on_ranks


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_bit_packing_round_trips(bits):
    values = torch.randint(0, 2**bits, (1001,), dtype=torch.uint8)
    packed = _pack_bits(values, bits)
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(_unpack_bits(packed, bits, 1001), values)


def test_topk_message_keeps_the_largest_entries():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 1.0, 0.3])
    c = TopK(ratio=0.25)  # k = 2
    payload, residual = c.encode(x.clone(), None)
    decoded = x - residual
    assert payload.numel() == c.payload_nbytes(8, 4) == 2 * 8
    assert torch.equal(decoded, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0]))
    out = torch.zeros(8)
    c.decode_add_(payload, out)
    assert torch.equal(out, decoded)


def test_onebit_message_is_signs_times_mean_magnitude():
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, 0.5, -1.0, 4.0, 2.0])
    c = OneBit()
    payload, residual = c.encode(x.clone(), None)
    decoded = x - residual
    assert payload.numel() == c.payload_nbytes(9, 4) == 4 + 2
    scale = x.abs().mean()
    assert torch.allclose(decoded, torch.where(x >= 0, scale, -scale))
    out = torch.zeros(9)
    c.decode_add_(payload, out)
    torch.testing.assert_close(out, decoded)  # x - (x - s) equals s up to rounding


def test_onebit_blocks_carry_one_mean_magnitude_each():
    """``OneBit(block=4)``: each block of 4 (the last one of 1) is sent as signs times its own mean magnitude."""
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, 0.5, -1.0, 4.0, 2.0])
    c = OneBit(block=4)
    payload, residual = c.encode(x.clone(), None)
    assert payload.numel() == c.payload_nbytes(9, 4) == 4 * 3 + 2
    scales = torch.tensor([2.0] * 4 + [1.5] * 4 + [2.0])
    assert torch.allclose(x - residual, torch.where(x >= 0, scales, -scales))
    out = torch.zeros(9)
    c.decode_add_(payload, out)
    torch.testing.assert_close(out, x - residual)
    # Magnitudes that vary within a tensor: closer than one scale for all, for 32 / block more bits per value.
    y = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, 4096)
    errors = [float(c.encode(y.clone(), None)[1].norm()) for c in (OneBit(), OneBit(block=256))]
    assert errors[1] < 0.9 * errors[0]
    assert repr(OneBit()) == "OneBit(error_feedback=True, min_compress_numel=0, warmup_steps=0)"  # checkpoints
    with pytest.raises(ValueError, match="block"):
        OneBit(block=1)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_is_unbiased_and_decodes_what_it_reports(bits):
    c = Quantize(bits, block=64)
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(300)
    draws = 2000
    for i in range(draws):
        payload, residual = c.encode(x.clone(), torch.Generator().manual_seed(i))
        decoded = x - residual
        out = torch.zeros(300)
        c.decode_add_(payload, out)
        torch.testing.assert_close(out, decoded, rtol=0, atol=1e-6)  # receivers see what the sender accounts for
        total += decoded
    # Unbiased: the mean of many draws converges to x (standard error ~ scale / sqrt(draws)).
    scale = x.abs().max() / c.levels
    assert (total / draws - x).abs().max() < 5 * scale / math.sqrt(draws)


def test_sampled_topk_selection_is_the_exact_topk():
    g = torch.Generator().manual_seed(0)
    for n, k in [(200_000, 2000), (100_000, 1), (70_000, 17_000), (300_000, 3000)]:
        x = torch.randn(n, generator=g).abs()
        if n == 300_000:
            x[::7] *= 100  # structured magnitudes: most of the top-k sit on a stride
        got = torch.sort(_topk_index(x, k)).values
        want = torch.sort(x.topk(k).indices).values
        assert torch.equal(got, want), (n, k)


def test_analytic_byte_ratios_at_two_ranks():
    shape, dense = torch.Size((512, 512)), allreduce_bytes(512 * 512 * 4, 2)
    assert dense / TopK(0.01).sent_bytes(shape, 4, 2) == pytest.approx(50, rel=0.01)
    assert dense / OneBit().sent_bytes(shape, 4, 2) == pytest.approx(32, rel=0.01)
    assert dense / Cast().sent_bytes(shape, 4, 2) == 2
    assert dense / PowerSGD(rank=4).sent_bytes(shape, 4, 2) == 64
    assert not PowerSGD(rank=4).compressible(torch.Size((512,)))  # vectors go dense
    assert not PowerSGD(rank=4).compressible(torch.Size((6, 5)))  # factors would not be smaller


def _grads(rank: int, step: int, shapes: list[tuple[int, ...]], low_rank: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if low_rank:  # each rank's matrices have rank 1, so their average has rank <= 2
        return [torch.outer(torch.randn(s[0], generator=g), torch.randn(s[1], generator=g)) if len(s) == 2
                else torch.randn(s, generator=g) for s in shapes]  # fmt: skip
    return [torch.randn(s, generator=g) for s in shapes]


class _Params(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


def _exchange(
    rank: int, compressor, shapes, steps: int, poison_step: int | None = None, low_rank: bool = False
) -> dict:
    module = _Params(shapes)
    engine = GradientCompression(compressor, module)
    params = list(module.parameters())
    outputs, inputs, snapshots = [], [], {}

    def snapshot() -> tuple[dict, dict]:
        return ({k: v.clone() for k, v in engine.errors.items()}, {k: v.clone() for k, v in engine.factors.items()})

    for step in range(steps):
        grads = _grads(rank, step, shapes, low_rank)
        if step == poison_step and rank == 0:
            grads[0].view(-1)[0] = float("inf")
        if step == poison_step:
            snapshots["before"] = snapshot()
        buffer = torch.cat([g.reshape(-1) for g in grads])
        inputs.append(buffer.clone())
        engine.exchange(buffer, engine.segments(buffer, params)).wait()
        outputs.append(buffer.clone())
        engine.advance()
        if step == poison_step:
            snapshots["after"] = snapshot()
    engine.close()
    errors = torch.cat([engine.errors[f"ps.{i}"] if f"ps.{i}" in engine.errors else torch.zeros(math.prod(s))
                        for i, s in enumerate(shapes)])  # fmt: skip
    return {
        "inputs": inputs,
        "outputs": outputs,
        "errors": errors,
        "snapshots": snapshots,
        "sent": engine.sent_bytes,
        "dense": engine.dense_bytes,
    }


def _exchange_each(rank: int, compressors, *args) -> list[dict]:
    return [_exchange(rank, c, *args) for c in compressors]


SHAPES = [(48, 40), (40,), (16, 48)]


@pytest.mark.integration
def test_compressed_average_matches_dense_average():
    cases = [
        (TopK(ratio=1.0), 1e-6),  # every entry sent: exact up to summation order
        (PowerSGD(rank=2), 1e-4),  # rank-1 gradients per rank: the rank-2 average is found exactly (round-off)
        (Cast("fp16"), 2e-2),  # fp16 keeps 11 significant bits; |x| < 16 for these draws
        (Quantize(8, block=16), 16.0 / 127),  # at most one quantization step (block max / 127) per rank
    ]
    assert all(PowerSGD(rank=2).compressible(torch.Size(s)) for s in SHAPES if len(s) == 2)
    runs = run_on_ranks(_exchange_each, [c for c, _ in cases], SHAPES, 2, None, True)
    for i, (compressor, atol) in enumerate(cases):
        r0, r1 = runs[0][i], runs[1][i]
        for step in range(2):
            dense = (r0["inputs"][step] + r1["inputs"][step]) / 2
            assert torch.equal(r0["outputs"][step], r1["outputs"][step]), f"{compressor}: replicas differ"
            torch.testing.assert_close(r0["outputs"][step], dense, rtol=0, atol=atol, msg=repr(compressor))


@pytest.mark.integration
def test_error_feedback_loses_nothing_over_steps():
    """Error feedback telescopes: sum of averaged outputs + mean final error = sum of averaged inputs."""
    compressors = [TopK(0.05), OneBit(), PowerSGD(rank=2)]
    runs = run_on_ranks(_exchange_each, compressors, SHAPES, 4)
    for i, compressor in enumerate(compressors):
        r0, r1 = runs[0][i], runs[1][i]
        sent = sum(r0["outputs"])
        given = sum((r0["inputs"][t] + r1["inputs"][t]) / 2 for t in range(4))
        carried = (r0["errors"] + r1["errors"]) / 2
        torch.testing.assert_close(sent + carried, given, rtol=0, atol=1e-4, msg=repr(compressor))
        assert (sent - given).abs().max() > 1e-2, f"{compressor} should have left something out"


@pytest.mark.integration
def test_overflow_reaches_every_rank_and_leaves_state_untouched():
    """Rank 0's gradient overflows (inf) at step 1: every rank gets non-finite averages (a gradient
    scaler then skips the step everywhere), rank 0's error buffers and the shared factors are kept."""
    compressors = [Cast("fp16", error_feedback=True), TopK(0.1), OneBit(), PowerSGD(rank=2)]
    runs = run_on_ranks(_exchange_each, compressors, SHAPES, 3, 1)
    for i, compressor in enumerate(compressors):
        for rank in (0, 1):
            r = runs[rank][i]
            assert not torch.isfinite(r["outputs"][1]).all(), f"{compressor}: rank {rank} missed the overflow"
            assert torch.isfinite(r["outputs"][2]).all(), f"{compressor}: the next step is clean again"
            assert torch.isfinite(r["errors"]).all()
        (errors_before, factors_before), (errors_after, factors_after) = (
            runs[0][i]["snapshots"]["before"], runs[0][i]["snapshots"]["after"])  # fmt: skip
        assert errors_before.keys() == errors_after.keys() and errors_before, repr(compressor)
        for key, value in errors_before.items():
            assert torch.equal(errors_after[key], value), f"{compressor}: error buffer {key} changed"
        for key, value in factors_before.items():
            assert torch.equal(factors_after[key], value), f"{compressor}: factor {key} changed"


@pytest.mark.integration
def test_counted_bytes_reach_the_analytic_ratio():
    compressors = [TopK(0.01), OneBit(), PowerSGD(rank=4), Quantize(8), Quantize(4), Cast()]
    shapes = [(256, 512), (512, 128)]
    runs = run_on_ranks(_exchange_each, compressors, shapes, 1)
    for i, compressor in enumerate(compressors):
        analytic = sum(allreduce_bytes(math.prod(s) * 4, 2) for s in shapes) / sum(
            compressor.sent_bytes(torch.Size(s), 4, 2) for s in shapes
        )
        measured = runs[0][i]["dense"] / runs[0][i]["sent"]
        assert 0.98 * analytic <= measured <= 1.02 * analytic, repr(compressor)


# -- ZeRO-2: the compressed reduce-scatter (each rank keeps its slice of the average) --


def _reduce_scatter(
    rank: int, compressor, shapes, steps: int, poison_step: int | None = None, low_rank: bool = False
) -> dict:
    """Each step: the parameters' gradients laid out in one bucket padded to a multiple of 2 (as ZeRO-2 lays them
    out), this rank's averaged slice back."""
    module = _Params(shapes)
    engine = GradientCompression(compressor, module, sharded=True)
    params = list(module.parameters())
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    total = sum(math.prod(s) for s in shapes)
    chunk = -(-total // 2)
    outputs, inputs, errors_after = [], [], []
    for step in range(steps):
        grads = _grads(rank, step, shapes, low_rank)
        if step == poison_step and rank == 0:
            grads[0].view(-1)[-1] = float("inf")  # in rank 1's slice: rank 0's own slice stays finite
        buffer = torch.nn.functional.pad(torch.cat([g.reshape(-1) for g in grads]), (0, 2 * chunk - total))
        inputs.append(buffer.clone())
        outputs.append(engine.reduce_scatter(buffer, params, offsets, chunk).wait().clone())
        engine.advance()
        errors_after.append({k: v.clone() for k, v in engine.errors.items()})
    engine.close()
    return {"inputs": inputs, "outputs": outputs, "errors": errors_after, "sent": engine.sent_bytes,
            "dense": engine.dense_bytes, "state_bytes": engine.state_bytes(), "chunk": chunk}  # fmt: skip


def _reduce_scatter_each(rank: int, compressors, *args) -> list[dict]:
    return [_reduce_scatter(rank, c, *args) for c in compressors]


def _flat_errors(errors: dict, shapes) -> torch.Tensor:
    """The pieces' error buffers ("ps.i[a:b]") put back where their parameters lie in the bucket."""
    out = torch.zeros(sum(math.prod(s) for s in shapes))
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    for key, value in errors.items():
        name, _, span = key.partition("[")  # PowerSGD keeps whole parameters' errors: no range
        a, b = (int(x) for x in span.rstrip("]").split(":")) if span else (0, value.numel())
        start = offsets[int(name.removeprefix("ps."))]
        out[start + a : start + b] = value
    return out


@pytest.mark.integration
def test_compressed_reduce_scatter_gives_each_rank_its_slice_of_the_average():
    """TopK(1.0) sends everything (exact), PowerSGD finds rank-1-per-rank averages, Quantize is within one step; a
    parameter cut by the slice boundary (the first, 48 x 40 = 1920 of 2728 values) is split between the ranks."""
    cases = [
        (TopK(ratio=1.0), 1e-6),
        (PowerSGD(rank=2), 1e-4),
        (Quantize(8, block=16), 16.0 / 127),
        (TopK(ratio=1.0, min_compress_numel=100), 1e-6),
    ]  # fmt: skip  (the last: the bias travels dense)
    runs = run_on_ranks(_reduce_scatter_each, [c for c, _ in cases], SHAPES, 2, None, True)
    for i, (compressor, atol) in enumerate(cases):
        r0, r1 = runs[0][i], runs[1][i]
        chunk = r0["chunk"]
        assert chunk < 48 * 40  # the slice boundary cuts the first matrix
        for step in range(2):
            dense = (r0["inputs"][step] + r1["inputs"][step]) / 2
            got = torch.cat([r0["outputs"][step], r1["outputs"][step]])
            torch.testing.assert_close(got, dense, rtol=0, atol=atol, msg=repr(compressor))


@pytest.mark.integration
def test_compressed_reduce_scatter_error_feedback_loses_nothing():
    """Per rank, what its slices received plus its carried error telescopes to what it was given, with the error
    buffers updated in place (one per piece of a parameter)."""
    compressors = [TopK(0.05), OneBit(), PowerSGD(rank=2)]
    steps = 4
    runs = run_on_ranks(_reduce_scatter_each, compressors, SHAPES, steps)
    for i, compressor in enumerate(compressors):
        r0, r1 = runs[0][i], runs[1][i]
        sent = sum(torch.cat([r0["outputs"][t], r1["outputs"][t]]) for t in range(steps))
        given = sum((r0["inputs"][t] + r1["inputs"][t]) / 2 for t in range(steps))
        carried = (_flat_errors(r0["errors"][-1], SHAPES) + _flat_errors(r1["errors"][-1], SHAPES)) / 2
        total = sum(math.prod(s) for s in SHAPES)
        torch.testing.assert_close(sent[:total] + carried, given[:total], rtol=0, atol=1e-4, msg=repr(compressor))
        assert (sent - given).abs().max() > 1e-2, f"{compressor} should have left something out"
        if not isinstance(compressor, PowerSGD):  # one piece per rank's slice of the cut parameter
            assert {"ps.0[0:1364]", "ps.0[1364:1920]"} <= r0["errors"][-1].keys(), r0["errors"][-1].keys()
        assert r0["state_bytes"] >= 4 * total  # one fp32 error buffer per gradient entry (PowerSGD: + its Q)


@pytest.mark.integration
def test_compressed_reduce_scatter_overflow_is_agreed_and_restarts_error_feedback():
    """Rank 0's gradient overflows inside rank 1's slice: rank 1's slice is not finite, rank 0's is; the ranks
    agree the step was not finite (a gradient scaler skips it everywhere) and both restart error feedback."""
    runs = run_on_ranks(_reduce_scatter_each, [TopK(0.1), OneBit()], SHAPES, 3, 1)
    for i in range(2):
        assert torch.isfinite(runs[0][i]["outputs"][1]).all() and not torch.isfinite(runs[1][i]["outputs"][1]).all()
        for rank in (0, 1):
            errors = runs[rank][i]["errors"]
            assert all(bool((v == 0).all()) for v in errors[1].values()), f"rank {rank}: errors not restarted"
            assert all(bool(v.abs().sum() > 0) for v in errors[2].values()), "error feedback resumes the next step"
            assert all(torch.isfinite(v).all() for v in errors[2].values())


@pytest.mark.integration
def test_compressed_reduce_scatter_bytes_against_a_dense_reduce_scatter():
    """Counted bytes against an fp32 reduce-scatter of the same bucket: each rank's slice goes to that rank only,
    so 1-bit sends 1/32 of a dense reduce-scatter (an all-gather of whole messages would send 1/16 at N=2)."""
    compressors = [OneBit(), TopK(0.01), Quantize(8), PowerSGD(rank=4)]
    shapes = [(256, 512), (512, 128)]
    runs = run_on_ranks(_reduce_scatter_each, compressors, shapes, 1)
    total = sum(math.prod(s) for s in shapes)
    for i, compressor in enumerate(compressors):
        ratio = runs[0][i]["dense"] / runs[0][i]["sent"]
        assert runs[0][i]["dense"] == reducescatter_bytes(total * 4, 2)
        if isinstance(compressor, PowerSGD):  # its factors are all-reduced: twice the reduce-scatter's share
            analytic = reducescatter_bytes(total * 4, 2) / sum(compressor.sent_bytes(torch.Size(s), 4, 2)
                                                               for s in shapes)  # fmt: skip
        else:
            analytic = reducescatter_bytes(total * 4, 2) / sum(
                compressor.sent_bytes(torch.Size(s), 4, 2) / 2 for s in shapes)  # fmt: skip
        assert 0.98 * analytic <= ratio <= 1.02 * analytic, (repr(compressor), ratio, analytic)
    onebit = runs[0][0]["dense"] / runs[0][0]["sent"]
    assert onebit > 31, onebit
