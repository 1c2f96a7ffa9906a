"""Gradient compression on CUDA tensors over NCCL (skipped without a GPU; two-rank NCCL needs two GPUs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.compression import Cast, GradientCompression, OneBit, PowerSGD, Quantize, TopK
from tests.helpers.distributed import free_port
from tests.helpers.markers import gpu

pytestmark = gpu


@pytest.fixture
def nccl_group():
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "compressor", [TopK(1.0), PowerSGD(rank=2), Cast("bf16"), OneBit(), Quantize(8), TopK(0.01)], ids=repr
)
def test_exchange_on_cuda_tensors_over_nccl(nccl_group, compressor):
    module = nn.Sequential(nn.Linear(256, 32), nn.Linear(32, 256)).cuda()
    engine = GradientCompression(compressor, module)
    params = list(module.parameters())
    # Rank-1 weight gradients: PowerSGD(rank=2) recovers them exactly; vectors go dense.
    u, v, w = torch.randn(32, device="cuda"), torch.randn(256, device="cuda"), torch.randn(32, device="cuda")
    grads = torch.cat([torch.outer(u, v).reshape(-1), torch.randn(32, device="cuda"),
                       torch.outer(v, w).reshape(-1), torch.randn(256, device="cuda")])  # fmt: skip
    for _ in range(3):
        buffer = grads.clone()
        engine.exchange(buffer, engine.segments(buffer, params)).wait()
        engine.advance()
        assert buffer.device.type == "cuda" and torch.isfinite(buffer).all()
    if isinstance(compressor, TopK) and compressor.ratio == 1.0:
        torch.testing.assert_close(buffer, grads)  # one rank, everything sent: the gradient itself
    if isinstance(compressor, PowerSGD):
        torch.testing.assert_close(buffer, grads, rtol=0, atol=1e-3)
    if compressor.error_feedback:
        assert all(e.device.type == "cuda" for e in engine.errors.values())
    engine.close()
