"""FlatShardedOptimizer (ZeRO-1) on 2 gloo ranks: same updates as the unsharded optimizer, exact bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.engines.flat_shard import FlatShardedOptimizer
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration


class Lion(torch.optim.Optimizer):
    """Sign of an interpolated momentum (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023):
    element-wise, and not among the optimizers the package knows by class."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class LambLike(torch.optim.Adam):
    """An Adam subclass whose step scales each tensor's update by a trust ratio (LAMB's idea, You et al., 2020)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                ratio = p.norm() / p.grad.norm().clamp(min=1e-6)
                p.add_(p.grad * ratio, alpha=-group["lr"])


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 7*5+5 + 5*3 = 55 parameters: odd, so the flat group needs padding to split over 2 ranks.
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def _steps(rank: int, optimizer_name: str, bucket_bytes: int = 25 * 2**20, shard_gradients: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_bigtrain.functional.memory import model_state_bytes

    mesh = init_device_mesh("cpu", (2,))
    reference, sharded = _net(), _net()
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "lion": lambda ps: Lion(ps, lr=0.01),  # an element-wise optimizer this package does not know by name
    }[optimizer_name]
    ref_opt = make(reference.parameters())
    opt = FlatShardedOptimizer(make(sharded.parameters()), mesh, bucket_bytes, shard_gradients)
    for step in range(5):
        torch.manual_seed(100 + step)
        xs = torch.randn(2, 4, 7)  # both ranks draw both halves of the global batch
        # Reference: the full batch on one replica (what averaging over 2 ranks of 4 samples computes).
        ref_opt.zero_grad()
        torch.stack([reference(x).pow(2).mean() for x in xs]).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        sharded(xs[rank]).pow(2).mean().backward()  # reduce-scatter runs at the end of backward
        opt.step()
    opt.zero_grad()
    sharded(xs[rank]).pow(2).mean().backward()  # gradients present, as at the step's peak
    state = model_state_bytes(sharded, opt)
    return {
        "buckets": len(opt._buckets),
        "ref": torch.cat([p.detach().reshape(-1) for p in reference.parameters()]),
        "ours": torch.cat([p.detach().reshape(-1) for p in sharded.parameters()]),
        "state": state,
        "comm": opt.comm_bytes,
        "grad_is_none": all(p.grad is None for p in sharded.parameters()),
    }


@pytest.mark.parametrize(
    ("optimizer_name", "shard_gradients"),
    [("adamw", False), ("adamw", True), ("sgd", False), ("sgd", True), ("lion", True)],
    ids=["adamw-stage1", "adamw-stage2", "sgd-stage1", "sgd-stage2", "lion-stage2"],
)
def test_matches_the_unsharded_optimizer(optimizer_name, shard_gradients):
    results = run_on_ranks(_steps, optimizer_name, 25 * 2**20, shard_gradients)
    for r in results:
        torch.testing.assert_close(r["ours"], r["ref"], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0]["ours"], results[1]["ours"])
    if optimizer_name == "adamw":
        # 55 params in one bucket padded to 56: parameters replicated (4 B each); exp_avg + exp_avg_sq on
        # this rank's 28 / 27 elements, plus the step counter; gradients replicated (stage 1) or this
        # rank's 28-element slice only (stage 2).
        assert [r["state"]["optimizer"] for r in results] == [8 * 28 + 4, 8 * 27 + 4]
        assert all(r["state"]["params"] == 4 * 56 for r in results)
        assert all(r["state"]["grads"] == (4 * 28 if shard_gradients else 4 * 56) for r in results)
    assert all(r["grad_is_none"] == shard_gradients for r in results)
    # Per step: reduce-scatter + all-gather of the padded 56-element bucket, half of each sent (and the
    # extra backward above reduces once more).
    assert all(r["comm"] == 5 * 2 * 28 * 4 + 28 * 4 for r in results)


def test_many_buckets_give_the_same_updates():
    # 64-byte buckets: every parameter tensor in a bucket of its own, reduced as soon as it is ready.
    results = run_on_ranks(_steps, "adamw", 64, True)
    for r in results:
        assert r["buckets"] == 3
        torch.testing.assert_close(r["ours"], r["ref"], rtol=1e-5, atol=1e-6)


def _reject(rank: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    messages = {}
    for make in (torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.Rprop, LambLike):
        try:
            FlatShardedOptimizer(make(_net().parameters()), mesh)
        except TypeError as err:
            messages[make.__name__] = str(err)
    return messages


def test_rejects_optimizers_that_are_not_elementwise_or_cannot_step_dtensor_slices():
    messages = run_on_ranks(_reject)[0]
    # Not element-wise; stage 3 suggested only where the optimizer can step DTensor shards (LBFGS can, torch's
    # Adafactor cannot).
    assert (
        "cannot shard LBFGS" in messages["LBFGS"]
        and "updates a parameter's flat slices differently" in messages["LBFGS"]
    )
    assert "Use stage=3" in messages["LBFGS"]
    assert "cannot shard Adafactor" in messages["Adafactor"] and "Use stage=3" not in messages["Adafactor"]
    # A subclass of Adam that overrides the step with a per-tensor trust ratio is not taken by its class.
    assert "cannot shard LambLike" in messages["LambLike"]
    # Element-wise, but torch's Rprop cannot step DTensor slices: DeepSpeed's plain partitions suggested.
    assert "cannot step them" in messages["Rprop"] and "DeepSpeedZeroStrategy(stage=1)" in messages["Rprop"]


def _fp16_overflow(rank: int, shard_gradients: bool) -> dict:
    """fp16 replicas with dynamic loss scaling: an overflow in one rank's gradient slice only."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_bigtrain.engines.flat_shard import FlatGradScaler

    mesh = init_device_mesh("cpu", (2,))
    net = _net()
    opt = FlatShardedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.05), mesh, shard_gradients=shard_gradients,
                               param_dtype=torch.float16)  # fmt: skip
    scaler = FlatGradScaler(device="cpu", init_scale=2.0**8, process_group=mesh.get_group())
    out = []
    for step in range(2):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 4, 7)[rank].half()
        opt.zero_grad()
        scaler.scale(net(x).float().pow(2).mean()).backward()
        if step == 0 and rank == 1:  # only rank 1 sees the overflow, in the slice it owns
            opt._pairs[0][1].grad.to_local()[0] = float("inf")
        before = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
        scaler.step(opt)
        scaler.update()
        after = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        out.append({"changed": bool((after != before).any()), "scale": float(scaler.get_scale()), "w": after})
    return {"steps": out, "dtype": next(net.parameters()).dtype}


@pytest.mark.parametrize("shard_gradients", [False, True], ids=["stage1", "stage2"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(shard_gradients):
    """Each rank checks only its own gradient slices; FlatGradScaler agrees on the overflow over the group, so both
    ranks skip the step and halve the scale alike, and the next step updates both to the same weights."""
    r0, r1 = run_on_ranks(_fp16_overflow, shard_gradients)
    assert r0["dtype"] == r1["dtype"] == torch.float16
    for r in (r0, r1):
        assert not r["steps"][0]["changed"] and r["steps"][0]["scale"] == 2.0**7  # skipped, scale halved
        assert r["steps"][1]["changed"] and r["steps"][1]["scale"] == 2.0**7
    torch.testing.assert_close(r0["steps"][1]["w"], r1["steps"][1]["w"], rtol=0, atol=0)


def _synced_backwards(rank: int, shard_gradients: bool, no_sync_middle: bool) -> float:
    """Three backward passes before one SGD step (DDP's semantics: each synchronised pass all-reduces the sum so far),
    the first after ``module.zero_grad()`` (gradients None, as Lightning leaves them before a run); optionally the
    middle one under ``require_sync = False`` (DDP's ``no_sync``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    reference, sharded = _net(), _net()
    opt = FlatShardedOptimizer(torch.optim.SGD(sharded.parameters(), lr=1.0), mesh, 64, shard_gradients)
    sharded.zero_grad()
    xs = [torch.randn(3, 7, generator=torch.Generator().manual_seed(10 * k + rank)) for k in range(3)]
    for k, x in enumerate(xs):
        opt.begin_backward()  # what ZeroStrategy.backward calls
        opt.require_sync = not (no_sync_middle and k == 1)
        sharded(x).sum().backward()
    opt.require_sync = True
    for x in xs:
        reference(x).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.distributed.all_reduce(grads)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]) - grads / 2
    opt.step()
    return float((torch.cat([p.detach().reshape(-1) for p in sharded.parameters()]) - expected).abs().max())


@pytest.mark.parametrize(("shard_gradients", "no_sync_middle"), [(False, False), (False, True), (True, False)],
                         ids=["stage1", "stage1_no_sync_middle", "stage2"])  # fmt: skip
def test_several_synchronised_backward_passes_accumulate_as_ddp(shard_gradients, no_sync_middle):
    """Manual optimization's accumulation: stage 1 reduced the slice it had already averaged again (so half of it was
    lost), and the first pass after ``module.zero_grad()`` wrote its gradients outside the buckets."""
    for error in run_on_ranks(_synced_backwards, shard_gradients, no_sync_middle):
        assert error < 1e-5
