"""Gradient compression on a real slow link: two network namespaces joined by a veth pair shaped with
``tc``, one rank in each (two "nodes"), gloo over that link.

    python -m benchmarks.compression [--quick] [--links 100mbit 1gbit] [--results-dir DIR]

Peers, in the same run: dense fp32 DDP, torch's own ``fp16_compress_hook`` (the 16-bit all-reduce every
claim must beat; Agarwal et al., MLSys 2022) and torch's ``powerSGD_hook``, both registered on DDP exactly
as torch ships them (Lightning would drop them on CPU). Ours: CompressedDDPStrategy with each compressor.

Per link and model: median step time over the timed steps (after warm-up; for the GPT the median of 3
rounds run in alternating order, the dense fp32 reference once), the speedup over the fp16 hook, bytes
this rank sent per step (counted by the strategy, analytic, and read off the veth interface's tx counter),
the communication fraction of the step (1 - compute-only step / step; the compute-only step is measured in
one process with the same per-rank batch) and the fp16 hook's Amdahl bound (fp16 step / compute-only step:
the speedup if communication cost nothing).
Quality does not depend on the link, so it is measured over loopback (2 ranks) after a fixed step budget:
GPT validation loss, CNN test accuracy over 3 seeds, each with a no-error-feedback ablation.

Needs root (``ip netns``, ``tc``); without it the link part is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from benchmarks.common import RESULTS_DIR, command_line, machine_info, print_table, ratio, run_worker, write_results

NS = ("bt_bench_a", "bt_bench_b")
IFACES = ("bt_veth_a", "bt_veth_b")
ADDRS = ("10.77.0.1", "10.77.0.2")

#: method -> (description, how it is built in the worker)
METHODS: dict[str, str] = {
    "fp32": "dense fp32 all-reduce (Lightning DDP)",
    "torch_fp16": "torch fp16_compress_hook",
    "torch_powersgd": "torch powerSGD_hook, rank 4",
    "fp16": "ours Cast('fp16')",
    "powersgd": "ours PowerSGD(rank=4)",
    "topk": "ours TopK(0.01)",
    "onebit": "ours OneBit()",
    "int8": "ours Quantize(8)",
    "int4": "ours Quantize(4)",
    "powersgd_noef": "ours PowerSGD(rank=4), no error feedback",
    "topk_noef": "ours TopK(0.01), no error feedback",
    "onebit_noef": "ours OneBit(), no error feedback",
    "powersgd_warm": "ours PowerSGD(rank=4), first 10 steps dense",
    "topk_warm": "ours TopK(0.01), first 10 steps dense",
    "onebit_adam": "ours OneBitAdam(): first 15% of steps dense, then 1-bit momentum, variance refreshed every 8th",
    "onebit_adam_frozen": "ours OneBitAdam(variance_refresh=None): the paper's 1-bit Adam, variance frozen",
    "onebit_adam_block": "ours OneBitAdam(compressor=OneBit(block=256), variance_refresh=None): scale per 256",
    "onebit_adam_q8": "ours OneBitAdam(compressor=Quantize(8), variance_refresh=None): the frozen variance alone",
    "onebit_adam_refresh8_w25": "ours OneBitAdam(warmup_steps=0.25): dense past the GPT's 20-step LR warm-up",
    "onebit_adam_raw": "ours OneBitAdam(preconditioned=False): the raw momentum exchanged, as the paper",
    "onebit_adam_powersgd": "ours OneBitAdam(compressor=PowerSGD(4)): the momentum as rank-4 factors",
    "onebit_adam_q8r": "ours OneBitAdam(compressor=Quantize(8)): near-lossless momentum, the variance's own cost",
    "onebit_adam_squares10": "ours OneBitAdam(refresh_from='squares', variance_refresh=10): the ranks' own variances",
    "onebit_adam_q8r_every2": "ours OneBitAdam(compressor=Quantize(8), variance_refresh=2): the variance's age",
    "onebit_adam_q8r_plain": "ours OneBitAdam(compressor=Quantize(8), track_scale=False, preconditioned=False)",
    "onebit_adam_refresh4_4bit": "ours OneBitAdam(variance_refresh=4, refresh_bits=4): fresher, coarser variance",
    "onebit_adam_refresh4_4bit_plain": "ours OneBitAdam(variance_refresh=4, refresh_bits=4, no tracked scale, not "
    "preconditioned): 1-bit momentum, a fresher variance, no guards",
    "onebit_adam_every2_plain": "ours OneBitAdam(variance_refresh=2, no tracked scale, not preconditioned): 1 bit's "
    "own cost",
    "onebit_adam_q8r_refresh4_4bit_plain": "ours OneBitAdam(Quantize(8) momentum, variance_refresh=4, refresh_bits=4, "
    "no guards): the 4-bit variance's own cost",
    "onebit_adam_refresh4_4bit_precond": "ours OneBitAdam(variance_refresh=4, refresh_bits=4, no tracked scale, "
    "preconditioned): the momentum exchanged in the update's units",
    "onebit_adam_block128_refresh4_4bit_plain": "ours OneBitAdam(OneBit(block=128) momentum, variance_refresh=4, "
    "refresh_bits=4, no guards): a scale per 128 entries",
    "onebit_adam_q8r_every2_plain": "ours OneBitAdam(Quantize(8) momentum, variance_refresh=2, no tracked scale, "
    "not preconditioned): the guards' own cost",
    "auto": "ours compression='auto': fp16 and PowerSGD(4) timed for 4 steps each, the faster kept (10% margin)",
    "powersgd_flat": "ours PowerSGD(rank=4), hierarchical=False: every rank in one flat exchange across nodes",
    "onebit_flat": "ours OneBit(), hierarchical=False: every rank in one flat exchange across nodes",
    "zero2": "ZeroStrategy(stage=2), dense fp32 reduce-scatter",
    "zero2_powersgd": "ours ZeroStrategy(stage=2, compression=PowerSGD(rank=4)): compressed reduce-scatter",
    "zero2_onebit": "ours ZeroStrategy(stage=2, compression=OneBit()): compressed reduce-scatter",
    "zero2_topk": "ours ZeroStrategy(stage=2, compression=TopK(0.01)): compressed reduce-scatter",
}


def _compressor(method: str) -> Any:
    """The compressor of ``method``: a name of :data:`METHODS`, or for a worker run by hand ``powersgd<r>`` (another
    rank) and ``<method>_w<steps>`` (that many dense steps first), e.g. ``powersgd16_w15``."""
    from lightning_bigtrain.compression import Cast, OneBit, PowerSGD, Quantize, TopK

    ef = False if method.endswith("_noef") else None
    warm = 10 if method.endswith("_warm") else 0
    if "_w" in method and method.rsplit("_w", 1)[1].isdigit():  # <method>_w<steps>: that many dense steps first
        method, steps = method.rsplit("_w", 1)
        warm = int(steps)
    base = method.removesuffix("_flat").removesuffix("_noef").removesuffix("_warm")
    if base.startswith("powersgd") and base != "powersgd":  # powersgd<r>: another rank
        return PowerSGD(rank=int(base.removeprefix("powersgd")), error_feedback=ef, warmup_steps=warm)
    return {
        "fp16": lambda: Cast("fp16"),
        "powersgd": lambda: PowerSGD(rank=4, error_feedback=ef, warmup_steps=warm),
        "topk": lambda: TopK(0.01, error_feedback=ef, warmup_steps=warm),
        "onebit": lambda: OneBit(error_feedback=ef),
        "int8": lambda: Quantize(8),
        "int4": lambda: Quantize(4),
    }[base]()


_PLAIN: dict[str, Any] = {"track_scale": False, "preconditioned": False}  # none of OneBitAdam's guards
#: OneBitAdam's variants by method name: (how the momentum is exchanged, OneBitAdam's keywords).
_ONEBIT_ADAM: dict[str, tuple[str, dict[str, Any]]] = {
    "onebit_adam": ("onebit", {}),  # the defaults
    "onebit_adam_raw": ("onebit", {"preconditioned": False}),  # the raw momentum exchanged (as the paper)
    "onebit_adam_powersgd": ("powersgd", {}),  # the momentum exchanged as PowerSGD(4) factors
    "onebit_adam_q8r": ("q8", {}),  # the momentum nearly lossless: the variance's own cost
    "onebit_adam_q8r_every2": ("q8", {"variance_refresh": 2}),  # ... and the variance refreshed every 2nd step
    "onebit_adam_q8r_plain": ("q8", _PLAIN),
    "onebit_adam_refresh4_4bit": ("onebit", {"variance_refresh": 4, "refresh_bits": 4}),
    # One factor at a time, no guards: the momentum's codec x the variance's refresh.
    "onebit_adam_every2_plain": ("onebit", {"variance_refresh": 2, **_PLAIN}),
    "onebit_adam_q8r_every2_plain": ("q8", {"variance_refresh": 2, **_PLAIN}),
    "onebit_adam_refresh4_4bit_plain": ("onebit", {"variance_refresh": 4, "refresh_bits": 4, **_PLAIN}),
    "onebit_adam_q8r_refresh4_4bit_plain": ("q8", {"variance_refresh": 4, "refresh_bits": 4, **_PLAIN}),
    "onebit_adam_refresh4_4bit_precond": (
        "onebit",
        {"variance_refresh": 4, "refresh_bits": 4, "track_scale": False, "preconditioned": True},
    ),
    "onebit_adam_block128_refresh4_4bit_plain": ("block128", {"variance_refresh": 4, "refresh_bits": 4, **_PLAIN}),
    # The momentum as low-rank factors, which leaves bytes for a fresher variance than 1 bit does.
    "onebit_adam_psgd8_refresh4_4bit_plain": ("powersgd8", {"variance_refresh": 4, "refresh_bits": 4, **_PLAIN}),
    "onebit_adam_topk2_refresh4_4bit_plain": ("topk2", {"variance_refresh": 4, "refresh_bits": 4, **_PLAIN}),
}


def _strategy(method: str) -> Any:
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    if method == "fp32":
        return DDPStrategy(start_method="popen")
    if method.startswith("zero2"):  # ZeRO-2, dense or with a compressed reduce-scatter
        from lightning_bigtrain.strategies import ZeroStrategy

        base = method.removeprefix("zero2").removeprefix("_")
        return ZeroStrategy(stage=2, compression=_compressor(base) if base else None)
    if method.startswith("torch_"):
        return _TorchHookDDP(method)
    if method == "auto":
        return CompressedDDPStrategy("auto")
    if method.startswith("onebit_adam"):
        from lightning_bigtrain.compression import OneBit, OneBitAdam, PowerSGD, Quantize, TopK

        if method in _ONEBIT_ADAM:
            momentum, kwargs = _ONEBIT_ADAM[method]
            if momentum != "onebit":  # OneBitAdam's own default otherwise
                kwargs = {**kwargs, "compressor": {"q8": lambda: Quantize(8, error_feedback=True),
                                                   "powersgd": lambda: PowerSGD(4),
                                                   "powersgd8": lambda: PowerSGD(8),
                                                   "topk2": lambda: TopK(0.02),
                                                   "block128": lambda: OneBit(block=128)}[momentum]()}  # fmt: skip
            return CompressedDDPStrategy(OneBitAdam(**kwargs))
        if method.startswith("onebit_adam_squares"):  # onebit_adam_squares<K>: the ranks' own variances every K
            every = int(method.removeprefix("onebit_adam_squares"))
            return CompressedDDPStrategy(OneBitAdam(refresh_from="squares", variance_refresh=every))
        # The earlier ablations, as they ran: the raw momentum exchanged, the variance untracked between refreshes.
        paper: dict[str, Any] = {"track_scale": False, "preconditioned": False, "refresh_from": "gradients"}
        if method.startswith("onebit_adam_refresh"):  # onebit_adam_refresh<K>[_w<percent>]: refresh every K
            every, _, warm = method.removeprefix("onebit_adam_refresh").partition("_w")
            return CompressedDDPStrategy(
                OneBitAdam(warmup_steps=int(warm or 15) / 100, variance_refresh=int(every), **paper)
            )
        if method == "onebit_adam_frozen":  # the paper's method: the variance frozen after the warm-up
            return CompressedDDPStrategy(OneBitAdam(variance_refresh=None, **paper))
        momentum = {"onebit_adam_block": OneBit(block=256), "onebit_adam_q8": Quantize(8, error_feedback=True)}[method]
        return CompressedDDPStrategy(OneBitAdam(compressor=momentum, variance_refresh=None, **paper))
    if method.endswith("_flat"):  # several ranks per node, exchanged as one flat group (no hierarchy)
        return CompressedDDPStrategy(_compressor(method), hierarchical=False)
    return CompressedDDPStrategy(_compressor(method))  # hierarchical where there are nodes of several ranks


class _TorchHookDDP(DDPStrategy):
    """Lightning DDP with one of torch's own comm hooks, registered on every device (the peer)."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self.method = method

    def _register_ddp_hooks(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        assert self.model is not None
        if self.method == "torch_fp16":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # type: ignore[operator]
        else:
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
            self.model.register_comm_hook(state, psgd.powerSGD_hook)  # type: ignore[operator]


def _build(model: str, quick: bool, seed: int = 0) -> tuple[Any, Any]:
    from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT, FashionCNN

    if model == "cnn":
        return FashionCNN(channels=(32, 64, 128)), FashionMNISTDataModule(batch_size=64, seed=seed)
    data = ShakespeareDataModule(block_size=128, batch_size=4)
    width, layers = (128, 2) if quick else (512, 8)  # 25.4M parameters
    return CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=layers, n_head=8, n_embd=width), data


def _tx_bytes(iface: str | None) -> int:
    if not iface:
        return 0
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def worker(mode: str, method: str, model: str, steps: int, warmup: int, seed: int, quick: bool, out: str) -> None:
    import lightning as L
    import torch

    from benchmarks.common import set_flush_denormal

    set_flush_denormal()
    torch.set_num_threads(1)  # two ranks share two cores (in the link runs each is its own "node")
    L.seed_everything(seed, verbose=False)
    module, data = _build(model, quick, seed)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    times: list[float] = []
    marks: dict[str, Any] = {}

    cumulative: list[tuple[float, float]] = []  # (sent, dense) bytes before each step

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            engine = getattr(trainer.strategy, "compression_engine", None)
            if engine is not None:
                cumulative.append((engine.sent_bytes, engine.dense_bytes))
            if trainer.global_step == warmup:
                marks["tx"] = _tx_bytes(iface)
                marks["sent"] = engine.sent_bytes if engine is not None else None
                marks["dense"] = engine.dense_bytes if engine is not None else None
                marks["intra"] = engine.intra_bytes if engine is not None else None
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.t0)

    common: dict[str, Any] = dict(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
    )  # fmt: skip
    if mode == "compute":
        trainer = L.Trainer(devices=1, limit_val_batches=0, **common)
    elif mode == "link":
        trainer = L.Trainer(devices=1, num_nodes=2, strategy=_strategy(method), limit_val_batches=0, **common)
    elif mode == "nodes":  # two "nodes" of two ranks each (the second rank of a node launched by Lightning)
        trainer = L.Trainer(devices=2, num_nodes=2, strategy=_strategy(method), limit_val_batches=0, **common)
    else:  # quality, over loopback; validation (GPT) on a fixed 32 batches after training only
        nodes = 2 if mode == "nodes_quality" else 1  # two "nodes" of two ranks (launched by run_on_link)
        trainer = L.Trainer(devices=2, num_nodes=nodes, strategy=_strategy(method), limit_val_batches=32,
                            val_check_interval=None, check_val_every_n_epoch=10_000, num_sanity_val_steps=0,
                            **common)  # fmt: skip
    trainer.fit(module, datamodule=data)
    result: dict[str, Any] = {"step_s": statistics.median(times[warmup:]), "steps": len(times)}
    if method.startswith("onebit_adam") and mode == "link":
        # Every variance_refresh-th step of the compressed phase exchanges 8-bit gradients instead of the 1-bit
        # momentum and is slower: the step is the mean over the timed steps (whole refresh cycles), not the median.
        result["step_s_median"], result["step_s"] = result["step_s"], statistics.fmean(times[warmup:])
    engine = getattr(trainer.strategy, "compression_engine", None)
    timed = steps - warmup
    if "tx" in marks:
        result["wire_bytes_per_step"] = (_tx_bytes(iface) - marks["tx"]) / timed
    if engine is not None and marks.get("sent") is not None:
        result["counted_bytes_per_step"] = (engine.sent_bytes - marks["sent"]) / timed
        result["counted_dense_bytes_per_step"] = (engine.dense_bytes - marks["dense"]) / timed
        result["hierarchical"] = engine.nodes is not None
        if engine.nodes is not None:
            result["counted_intra_node_bytes_per_step"] = (engine.intra_bytes - marks["intra"]) / timed
    if engine is not None:
        result["run_sent_bytes"], result["run_dense_bytes"] = engine.sent_bytes, engine.dense_bytes
        phase = getattr(trainer.optimizers[0], "warmup_steps", None)  # OneBitAdam: where the compressed phase starts
        if phase is not None and phase < len(cumulative):
            sent0, dense0 = cumulative[phase]
            result["momentum_warmup_steps"] = phase
            result["compressed_phase_sent_bytes"] = engine.sent_bytes - sent0
            result["compressed_phase_dense_bytes"] = engine.dense_bytes - dense0
    auto = getattr(trainer.strategy, "compression", None)
    if getattr(auto, "name", None) == "auto":
        result["auto_choice"] = repr(auto.choice)
        result["auto_chosen"] = auto.chosen
        result["auto_step_s"] = auto.step_seconds
    if mode in ("quality", "nodes_quality"):
        if model == "gpt":
            metrics = trainer.validate(module, datamodule=data, verbose=False)
            result["val_loss"] = metrics[0]["val_loss"]
        else:
            metrics = trainer.test(module, datamodule=data, verbose=False)
            result["test_acc"] = metrics[0]["test_acc"]
    result["params"] = sum(p.numel() for p in module.parameters())
    if method != "fp32" and not method.startswith(("torch_", "onebit_adam", "zero2", "auto")):
        result["analytic_ratio"] = _analytic_ratio(module, _compressor(method))
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(result))


def _onebit_adam_link_steps(method: str, warm: int) -> int:
    """Steps of a link run of a OneBitAdam method: its dense warm-up (a fraction of the run) ends where the timing
    starts, after ``warm`` steps, and two whole refresh cycles of the compressed phase are timed (one where two
    cannot be: a ``--quick`` run)."""
    optimizer = _strategy(method).momentum
    cycle = optimizer.variance_refresh or 1
    for cycles in (2, 1):
        if optimizer.resolve_warmup(warm + cycles * cycle) == warm:
            return warm + cycles * cycle
    raise ValueError(f"no run length puts {method}'s dense warm-up at {warm} steps")


def _analytic_ratio(module: Any, compressor: Any) -> float:
    """fp32 all-reduce bytes / the compressor's bytes for this model at 2 ranks, from the formulas."""
    from lightning_bigtrain.functional.compression import allreduce_bytes

    dense = sent = 0.0
    for p in module.parameters():
        full = allreduce_bytes(p.numel() * 4, 2)
        dense += full
        sent += compressor.sent_bytes(p.shape, 4, 2) if compressor.compressible(p.shape) else full
    return dense / sent


def nodes_main(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Two namespaces ("nodes") of two ranks each on the shaped link: bytes that cross the link per step (the veth's
    tx counter in namespace A: what node 0 sent to node 1) and step time, for dense fp32 DDP, our compressors in one
    flat exchange over the 4 ranks (``hierarchical=False``) and hierarchical (dense within the node, compressed
    across, each parameter sent by one rank of its node). One round, the GPT of the link runs."""
    why_not = link_available()
    if why_not is not None:
        print(f"nodes benchmark skipped: {why_not}")
        return {}
    rate = (args.links or ["100mbit"])[0]
    methods = args.methods or ["fp32", "powersgd_flat", "powersgd", "onebit_flat", "onebit", "fp16"]
    if "fp32" not in methods:
        methods = ["fp32", *methods]
    total, warm = (4, 2) if args.quick else (5, 2)
    extra = ["--quick"] if args.quick else []
    measured: dict[str, Any] = {}
    port = 29711
    try:
        link_up(rate)
        for method in methods:
            port += 1
            cmd = ["--worker", "nodes", "--method", method, "--model", "gpt", "--steps", str(total),
                   "--warmup", str(warm), *extra]  # fmt: skip
            r = run_on_link(cmd, port, per_node=2)
            measured[method] = r
            print(f"{rate} 2x2 {method}: {r['step_s']:.3f} s/step, {r.get('wire_bytes_per_step', 0) / 1e6:.2f} MB "
                  "across the link per step", flush=True)  # fmt: skip
    finally:
        link_down()
    # Quality at 2 x 2 ranks over loopback (it does not depend on the link): the CNN's test accuracy after the
    # quality runs' budget, dense against the flat and the hierarchical compressed exchange.
    quality: dict[str, Any] = {}
    quality_methods = [m for m in ("fp32", "powersgd_flat", "powersgd") if m in methods]
    total_q = 20 if args.quick else 150
    for method in quality_methods if args.nodes_seeds > 0 else []:
        values = []
        for seed in range(args.nodes_seeds):
            port += 1
            cmd = ["--worker", "nodes_quality", "--method", method, "--model", "cnn", "--steps", str(total_q),
                   "--warmup", "2", "--seed", str(seed), *extra]  # fmt: skip
            values.append(run_on_link(cmd, port, per_node=2, loopback=True)["test_acc"])
        quality[method] = {"values": values, "mean": statistics.fmean(values)}
        print(f"quality cnn 2x2 {method}: {values}", flush=True)
    for q in quality.values():
        q["acc_points_vs_fp32"] = 100 * (q["mean"] - quality["fp32"]["mean"])
    dense_wire, dense_step = measured["fp32"]["wire_bytes_per_step"], measured["fp32"]["step_s"]
    rows = []
    for method, r in measured.items():
        r["wire_ratio_vs_fp32"] = ratio(dense_wire, r["wire_bytes_per_step"])
        r["speedup_vs_fp32"] = ratio(dense_step, r["step_s"])
        rows.append({"method": method, "hierarchical": r.get("hierarchical", False), "step s": r["step_s"],
                     "vs fp32 step": r["speedup_vs_fp32"], "MB across link": r["wire_bytes_per_step"] / 1e6,
                     "fewer bytes than fp32": r["wire_ratio_vs_fp32"],
                     "MB within node (counted)": r.get("counted_intra_node_bytes_per_step", 0.0) / 1e6})  # fmt: skip
    print(f"\nTwo nodes x two ranks on a {rate} link (GPT, medians over {total - warm} timed steps, one round)")
    table = print_table(rows, list(rows[0]))
    best = max((m for m in measured if m != "fp32"), key=lambda m: measured[m]["wire_ratio_vs_fp32"])
    headline = (f"2 nodes x 2 ranks at {rate}: {best} {measured[best]['wire_ratio_vs_fp32']:.1f}x fewer bytes across "
                f"the link than dense fp32, step {measured[best]['speedup_vs_fp32']:.2f}x")  # fmt: skip
    payload = {"config": {"quick": args.quick, "link": rate, "steps": [total, warm], "ranks_per_node": 2,
                          "nodes": 2, "method_labels": {m: METHODS.get(m, m) for m in methods}},
               "machine": machine_info(),
               "figures": {"methods": measured, "table": table, "quality": {"model": "cnn", "steps": total_q,
                                                                          "methods": quality}}}  # fmt: skip
    path = write_results("compression_nodes", payload, headline, args.results_dir,
                         command=command_line("benchmarks.compression", argv))  # fmt: skip
    print(f"wrote {path}")
    return payload["figures"]


# -- the link: two namespaces, a veth pair, tc tbf on both ends --
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def link_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root: `ip netns` and `tc` need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def link_up(rate: str) -> None:
    link_down()
    _sh("ip", "link", "add", IFACES[0], "type", "veth", "peer", "name", IFACES[1])
    for ns, iface, addr in zip(NS, IFACES, ADDRS, strict=True):
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "set", iface, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
        _sh("ip", "-n", ns, "link", "set", iface, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    link_rate(rate)


def link_rate(rate: str) -> None:
    for ns, iface in zip(NS, IFACES, strict=True):
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "400ms")  # fmt: skip


def link_down() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", IFACES[0]], capture_output=True)


def run_on_link(
    args: list[str], port: int, timeout: float = 1800, per_node: int = 1, loopback: bool = False
) -> dict[str, Any]:
    """Node 0 in namespace A, node 1 in B; each node one process (``per_node=1``), or a launch whose other ranks
    Lightning starts in the same namespace. ``loopback``: the two nodes on this host's loopback instead (no
    namespaces: for quality runs, which do not depend on the link). Returns global rank 0's JSON."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs = []
        for rank, (ns, iface) in enumerate(zip(NS, IFACES, strict=True)):
            env = {**os.environ, "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(port), "NODE_RANK": str(rank),
                   "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": iface}  # fmt: skip
            if per_node > 1:  # Lightning launches the node's other ranks (LOCAL_RANK unset: not launched yet)
                env.pop("LOCAL_RANK")
                env["WORLD_SIZE"] = str(2 * per_node)
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.compression", *args, "--out", str(out)]
            if loopback:
                env["MASTER_ADDR"] = "127.0.0.1"
                env.pop("GLOO_SOCKET_IFNAME")
                cmd = cmd[4:]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            tail = "\n".join(log[-3000:] for log in logs)
            raise RuntimeError(f"link run {args} failed:\n{tail}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small GPT, few steps, one link (a smoke run)")
    parser.add_argument("--links", nargs="+", default=None, help="tc rates, e.g. 100mbit 1gbit")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the GPT link runs")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-link", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="only these link methods (fp32 and torch_fp16, the peers, always run)",
    )
    parser.add_argument("--models", nargs="+", choices=("gpt", "cnn"), default=None, help="only these link models")
    parser.add_argument("--area", default="compression", help="results file name (default: compression)")
    parser.add_argument(
        "--nodes",
        action="store_true",
        help="2 namespaces x 2 ranks: the hierarchical exchange against flat and dense (results: compression_nodes)",
    )
    parser.add_argument(
        "--nodes-seeds", type=int, default=3, help="with --nodes: CNN quality seeds at 2 x 2 ranks (0: none)"
    )
    parser.add_argument(
        "--worker", choices=("compute", "link", "nodes", "quality", "nodes_quality"), help=argparse.SUPPRESS
    )
    parser.add_argument("--method", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.method, args.model, args.steps, args.warmup, args.seed, args.quick, args.out)
        return {}

    if args.nodes:
        return nodes_main(args, argv)

    from lightning_bigtrain.compression import AutoCompression

    quick = args.quick
    extra = ["--quick"] if quick else []
    links = args.links or (["100mbit"] if quick else ["100mbit", "1gbit"])
    link_methods = {
        "gpt": ["fp32", "torch_fp16", "torch_powersgd", "fp16", "powersgd", "topk", "onebit", "int8", "int4"],
        "cnn": ["fp32", "torch_fp16", "powersgd", "topk", "onebit", "int8"],
    }
    if quick:
        link_methods = {"gpt": ["fp32", "torch_fp16", "powersgd", "topk"]}
    if args.models:
        link_methods = {m: v for m, v in link_methods.items() if m in args.models}
    if args.methods:
        link_methods = {m: list(dict.fromkeys(["fp32", "torch_fp16", *args.methods])) for m in link_methods}
    steps = {"gpt": (6, 2) if quick else (8, 3), "cnn": (30, 10)}  # (total, warm-up)
    repeats = {"gpt": 1 if quick else args.repeats, "cnn": 1}
    figures: dict[str, Any] = {"links": {}, "quality": {}, "compute_step_s": {}}
    rows: list[dict[str, Any]] = []

    def worker_args(mode: str, method: str, model: str, total: int, warm: int, seed: int = 0) -> list[str]:
        return ["--worker", mode, "--method", method, "--model", model, "--steps", str(total),
                "--warmup", str(warm), "--seed", str(seed), *extra]  # fmt: skip

    why_not = link_available()
    previous = args.results_dir / f"{args.area}.json"
    if args.skip_link and previous.exists():
        # Keep the link figures of the last full run; only the quality runs are redone.
        kept = json.loads(previous.read_text())["figures"]
        for key in ("links", "link_table", "compute_step_s"):
            if key in kept:
                figures[key] = kept[key]
        print(f"link benchmark skipped (--skip-link); link figures kept from {previous}")
    elif args.skip_link:
        why_not = "skipped (--skip-link)"
    if args.skip_link and "link_table" in figures:
        pass
    elif why_not is not None:
        print(f"link benchmark skipped: {why_not}")
        figures["links"] = {"skipped": why_not}
    else:
        for model in link_methods:
            total, warm = steps[model]
            compute = run_worker("benchmarks.compression", worker_args("compute", "fp32", model, total, warm))
            figures["compute_step_s"][model] = compute["step_s"]
        port = 29611
        try:
            for rate in links:
                link_up(rate)
                per_rate: dict[str, Any] = {}
                for model, methods in link_methods.items():
                    total, warm = steps[model]
                    compute_s = figures["compute_step_s"][model]
                    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
                    failed: dict[str, str] = {}
                    # Alternate the order each round (A B C, C B A, ...); the dense fp32 reference runs once.
                    for round_ in range(repeats[model]):
                        order = methods if round_ % 2 == 0 else methods[::-1]
                        for method in order:
                            if method in failed or (round_ > 0 and method == "fp32"):
                                continue
                            port += 1
                            # auto's trials (trial_steps per candidate) come before the timed steps
                            extra_steps = AutoCompression().trial_length if method == "auto" else 0
                            run_total = total + extra_steps
                            if method.startswith("onebit_adam"):
                                run_total = _onebit_adam_link_steps(method, warm)
                            try:
                                r = run_on_link(worker_args("link", method, model, run_total, warm + extra_steps), port)
                            except RuntimeError as err:
                                failed[method] = str(err)[-1500:]
                                print(f"{rate} {model} {method}: FAILED\n{failed[method]}")
                                continue
                            runs[method].append(r)
                            print(f"{rate} {model} {method} (round {round_}): {r['step_s']:.3f} s/step", flush=True)
                    measured: dict[str, Any] = {}
                    for method in methods:
                        if method in failed:
                            measured[method] = {"error": failed[method]}
                            continue
                        r = dict(runs[method][0])
                        r["step_s_runs"] = [x["step_s"] for x in runs[method]]
                        if method == "auto":
                            r["auto_choices"] = [x.get("auto_choice") for x in runs[method]]
                        r["step_s"] = statistics.median(r["step_s_runs"])
                        measured[method] = r
                    fp16 = measured["torch_fp16"]["step_s"]
                    fp32_wire = measured["fp32"].get("wire_bytes_per_step", 0.0)
                    for method, r in measured.items():
                        if "error" in r:
                            rows.append({"link": rate, "model": model, "method": method, "step s": "failed"})
                            continue
                        r["speedup_vs_torch_fp16"] = ratio(fp16, r["step_s"])
                        r["comm_fraction"] = max(0.0, 1 - compute_s / r["step_s"])
                        if r.get("counted_bytes_per_step"):
                            r["counted_ratio"] = r["counted_dense_bytes_per_step"] / r["counted_bytes_per_step"]
                        if fp32_wire and r.get("wire_bytes_per_step"):
                            r["wire_ratio_vs_fp32"] = fp32_wire / r["wire_bytes_per_step"]
                        rows.append({
                            "link": rate, "model": model, "method": method, "step s": r["step_s"],
                            "vs fp16 hook": r["speedup_vs_torch_fp16"],
                            "comm frac": r["comm_fraction"],
                            "bytes ratio counted": r.get("counted_ratio", ""),
                            "analytic": r.get("analytic_ratio", ""),
                            "wire ratio": r.get("wire_ratio_vs_fp32", ""),
                        })  # fmt: skip
                    per_rate[model] = {
                        "methods": measured,
                        "torch_fp16_comm_fraction": max(0.0, 1 - compute_s / fp16),
                        "amdahl_bound_vs_torch_fp16": fp16 / compute_s,
                    }
                figures["links"][rate] = per_rate
        finally:
            link_down()
        print("\nStep time on the shaped link (2 namespaces, 1 rank each; medians over timed steps)")
        link_table = print_table(rows, list(rows[0]))
        figures["link_table"] = link_table
        for rate, per_rate in figures["links"].items():
            for model, f in per_rate.items():
                print(f"{rate} {model}: fp16-hook comm fraction {f['torch_fp16_comm_fraction']:.2f}, "
                      f"Amdahl bound {f['amdahl_bound_vs_torch_fp16']:.2f}x")  # fmt: skip

    def write(stage: str) -> Path:
        headline_parts = []
        for rate, per_rate in figures["links"].items() if isinstance(figures["links"], dict) else []:
            if isinstance(per_rate, dict) and "gpt" in per_rate:
                measured = per_rate["gpt"]["methods"]
                ok = [m for m, r in measured.items() if "speedup_vs_torch_fp16" in r]
                if "auto" in ok:  # the auto run: auto against the best dense option on this link
                    dense = min(
                        (m for m in ("fp32", "torch_fp16", "fp16") if m in ok), key=lambda m: measured[m]["step_s"]
                    )
                    picks = "/".join(
                        sorted({(c or "?").split("(")[0] for c in measured["auto"].get("auto_choices", [])})
                    )
                    headline_parts.append(
                        f"{rate}: auto chose {picks}, {measured[dense]['step_s'] / measured['auto']['step_s']:.2f}x "
                        f"the best dense option ({dense})"
                    )
                    continue
                best = max(ok, key=lambda m: measured[m]["speedup_vs_torch_fp16"])
                headline_parts.append(f"{rate}: {best} {measured[best]['speedup_vs_torch_fp16']:.2f}x the fp16 hook")
        auto = AutoCompression()
        auto_config = {"candidates": [repr(c) for c in auto.candidates], "trial_steps": auto.trial_steps,
                       "margin": auto.margin}  # fmt: skip
        payload = {"config": {"quick": quick, "links": links, "steps": steps, "repeats": repeats, "stage": stage,
                              "method_labels": METHODS, "auto": auto_config},
                   "machine": machine_info(), "figures": figures}  # fmt: skip
        return write_results(args.area, payload, "GPT step: " + "; ".join(headline_parts), args.results_dir,
                             command=command_line("benchmarks.compression", argv))  # fmt: skip

    write("link")
    if not args.skip_quality:
        quality_methods = {
            "gpt": [
                "fp32",
                "torch_fp16",
                "powersgd",
                "topk",
                "onebit",
                "int8",
                "int4",
                "powersgd_warm",
                "topk_warm",
                "powersgd_noef",
                "topk_noef",
            ],
            "cnn": ["fp32", "torch_fp16", "powersgd", "topk", "onebit", "int8", "topk_noef"],
        }
        budgets = {"gpt": (8, 2) if quick else (100, 2), "cnn": (20, 2) if quick else (150, 2)}
        seeds = {"gpt": [0], "cnn": [0] if quick else [0, 1, 2]}
        qrows = []
        for model in ("gpt", "cnn"):
            total, warm = budgets[model]
            per_method: dict[str, Any] = {}
            for method in quality_methods[model]:
                values = []
                for seed in seeds[model]:
                    r = run_worker("benchmarks.compression", worker_args("quality", method, model, total, warm, seed))
                    values.append(r["val_loss" if model == "gpt" else "test_acc"])
                per_method[method] = {"values": values, "mean": statistics.fmean(values)}
                print(f"quality {model} {method}: {values}", flush=True)
            dense = per_method["fp32"]["mean"]
            for method, v in per_method.items():
                if model == "gpt":
                    v["rel_val_loss_vs_fp32"] = v["mean"] / dense - 1
                    gap = f"{100 * v['rel_val_loss_vs_fp32']:+.2f}%"
                else:
                    v["acc_points_vs_fp32"] = 100 * (v["mean"] - dense)
                    gap = f"{v['acc_points_vs_fp32']:+.2f} pts"
                qrows.append({"model": model, "method": method, "steps": total,
                              "metric": "val loss" if model == "gpt" else "test acc",
                              "mean": v["mean"], "vs fp32": gap,
                              "spread": max(v["values"]) - min(v["values"])})  # fmt: skip
            figures["quality"][model] = {"steps": total, "seeds": seeds[model], "methods": per_method}
        print("\nQuality after a fixed step budget (loopback, 2 ranks)")
        figures["quality_table"] = print_table(qrows, list(qrows[0]))

    path = write("complete")
    print(f"wrote {path}")
    return figures


#: Column labels of the rendered tables (short forms of METHODS).
SHORT = {"fp32": "fp32 DDP", "torch_fp16": "torch fp16 hook", "torch_powersgd": "torch powerSGD_hook",
         "fp16": "Cast(fp16)", "powersgd": "PowerSGD(4)", "topk": "TopK(0.01)", "onebit": "OneBit",
         "int8": "Quantize(8)", "int4": "Quantize(4)", "powersgd_noef": "PowerSGD(4), no EF",
         "topk_noef": "TopK(0.01), no EF", "onebit_noef": "OneBit, no EF",
         "powersgd_warm": "PowerSGD(4), dense warm-up", "topk_warm": "TopK(0.01), dense warm-up",
         "onebit_adam": "OneBitAdam", "onebit_adam_block": "OneBitAdam, OneBit(block=256)",
         "onebit_adam_q8": "OneBitAdam, Quantize(8)", "onebit_adam_frozen": "OneBitAdam, frozen variance",
         "onebit_adam_refresh8_w25": "OneBitAdam, 25% warm-up",
         "onebit_adam_raw": "OneBitAdam, raw momentum", "onebit_adam_powersgd": "OneBitAdam, PowerSGD(4) momentum",
         "onebit_adam_q8r": "OneBitAdam, Quantize(8) momentum",
         "onebit_adam_squares10": "OneBitAdam, ranks' variances every 10th", "auto": "compression='auto'"}  # fmt: skip


def _label(results: dict[str, Any], method: str) -> str:
    return SHORT.get(method) or (results.get("config") or {}).get("method_labels", METHODS).get(method, method)


def _rounds(results: dict[str, Any], methods: dict[str, Any]) -> str:
    counts = {m: len(r.get("step_s_runs", [])) for m, r in methods.items() if "error" not in r}
    groups: dict[int, list[str]] = {}
    for m, n in counts.items():
        groups.setdefault(n, []).append(_label(results, m))
    return ", ".join(f"{n} ({', '.join(ms)})" for n, ms in sorted(groups.items(), reverse=True))


def render_auto_block(results_dir: Path = RESULTS_DIR, name: str = "compression_auto.json") -> str:
    """The ``compression-auto`` figure block (docs/compression.md), from ``results/compression_auto.json``
    (``--methods fp16 powersgd auto --area compression_auto``): per link rate, ``compression="auto"``'s step
    against the best dense option measured on that link (the fastest of fp32 DDP, torch's fp16 hook and Cast(fp16))
    and PowerSGD(4)'s, with what auto chose in each round."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, name)
    f = results["figures"]
    lines = [measured_line(results, name, results_dir), ""]
    dense_methods = ("fp32", "torch_fp16", "fp16")
    auto_config = results["config"]["auto"]
    trials = " then ".join(f"`{c.split(', ')[0].removesuffix(')')})`" for c in auto_config["candidates"])
    lines += [
        "Two network namespaces joined by a shaped veth pair, one rank in each (the link benchmark above); the "
        f"char-GPT. `compression='auto'` runs {auto_config['trial_steps']} steps with each of {trials}, keeps the "
        f"fastest compressor if it is {100 * auto_config['margin']:.0f}% faster than the dense option, else the "
        "dense one; its step is timed after the trials. Ratios are step-time speed-ups over the best dense option "
        "measured on that link (> 1: faster).",
        "",
        "| link | fp32 DDP: step s | torch fp16 hook | Cast(fp16) | `auto` chose (per round) | `auto` | `auto` vs "
        "best dense | PowerSGD(4) | PowerSGD(4) vs best dense | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, per_rate in f["links"].items():
        methods = per_rate["gpt"]["methods"]
        ok = {m: r for m, r in methods.items() if "error" not in r}
        best = min(ok[m]["step_s"] for m in dense_methods if m in ok)
        auto = ok["auto"]
        chosen: dict[str, int] = {}
        for c in auto.get("auto_choices", []):
            label = (c or "?").split("(")[0]
            chosen[label] = chosen.get(label, 0) + 1
        picks = ", ".join(f"{k} {v}/{len(auto.get('auto_choices', []))}" for k, v in chosen.items())
        step = {m: (f"{sig(ok[m]['step_s'])} s" if m in ok else "-") for m in (*dense_methods, "powersgd")}
        powersgd = times(best / ok["powersgd"]["step_s"]) if "powersgd" in ok else "-"
        lines.append(
            f"| {rate} | {step['fp32']} | {step['torch_fp16']} | {step['fp16']} | {picks} | {sig(auto['step_s'])} s | "
            f"{times(best / auto['step_s'])} | {step['powersgd']} | {powersgd} | {len(auto['step_s_runs'])} |"
        )
    return "\n".join(lines)


def render_onebit_adam_link_block(results_dir: Path = RESULTS_DIR, name: str = "compression_onebit_adam.json") -> str:
    """The ``compression-onebit-adam`` figure block (docs/compression.md), from
    ``results/compression_onebit_adam.json`` (``--methods fp16 powersgd onebit_adam --area compression_onebit_adam``):
    per link rate, ``OneBitAdam()``'s step in its compressed phase (the mean over two whole refresh cycles) against
    torch's fp16 hook, beside PowerSGD(4)'s gradient compression, with the bytes of that phase."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, name)
    f = results["figures"]
    lines = [measured_line(results, name, results_dir), ""]
    lines += [
        "Two network namespaces joined by a shaped veth pair, one rank in each (the link benchmark under Measured); "
        f"the char-GPT. `OneBitAdam()` with its defaults ({results['config']['method_labels']['onebit_adam']}): "
        "its dense warm-up ends where the timing starts, then two whole refresh cycles of the compressed phase are "
        "timed (the refresh step exchanges 8-bit gradients instead of the 1-bit momentum) and its step is their "
        "mean; the others' is the median of their timed steps. "
        "Speed-ups over torch's `fp16_compress_hook` (> 1: faster); bytes: an fp32 all-reduce's over what the rank "
        "sent in the timed steps, counted by the strategy. The median of OneBitAdam's timed steps is that of its "
        "1-bit steps.",
        "",
        "| link | torch fp16 hook: step s | fp32 DDP | Cast(fp16) | PowerSGD(4) | OneBitAdam: step s (median) | "
        "OneBitAdam vs fp16 hook | OneBitAdam bytes fewer | rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, per_rate in f["links"].items():
        methods = per_rate["gpt"]["methods"]
        step = {m: r["step_s"] for m, r in methods.items() if "error" not in r}
        vs = {m: times(step["torch_fp16"] / step[m]) if m in step else "failed" if m in methods else "-"
              for m in ("fp32", "fp16", "powersgd", "onebit_adam")}  # fmt: skip
        adam = methods.get("onebit_adam", {})
        adam_cells = (
            f"{sig(adam['step_s'])} s ({sig(adam['step_s_median'])} s) | {vs['onebit_adam']} | "
            f"{times(adam['counted_ratio'])} | "
            f"{len(adam['step_s_runs'])}"
            if "onebit_adam" in step
            else "failed | failed | - | -"
        )
        lines.append(
            f"| {rate} | {sig(step['torch_fp16'])} s | {vs['fp32']} | {vs['fp16']} | {vs['powersgd']} | {adam_cells} |"
        )
    return "\n".join(lines)


def render_nodes_block(results_dir: Path = RESULTS_DIR, name: str = "compression_nodes.json") -> str:
    """The ``compression-nodes`` figure block (docs/compression.md), from ``results/compression_nodes.json``
    (``--nodes``): two namespaces of two ranks each on the shaped link; per method the bytes that crossed the link
    per step (read off the veth's transmit counter), as a ratio to dense fp32 DDP's, and the step against its; then
    the CNN's quality at 2 x 2 ranks."""
    from benchmarks.common import load_results, measured_line, points, sig, times

    results = load_results(results_dir, name)
    config, methods = results["config"], results["figures"]["methods"]
    steps, warm = config["steps"]
    params = next((r["params"] for r in methods.values() if "params" in r), None)
    lines = [measured_line(results, name, results_dir), ""]
    lines += [
        f'{config["nodes"]} network namespaces ("nodes") of {config["ranks_per_node"]} ranks each, joined by a veth '
        f"pair shaped to {config['link']} with `tc tbf`; the char-GPT ({sig(params / 1e6)}M parameters), "
        f"{steps - warm} timed steps after {warm}, one round, one CPU thread per rank (4 ranks on the 2 cores, so "
        "the steps are compute-bound slower than the 2-rank runs above). Bytes across the link: node 0's transmit "
        "counter per step; within the node: the strategy's count of its dense all-reduces (per rank). Hierarchical: "
        "`CompressedDDPStrategy`'s default with several nodes of several devices; flat: `hierarchical=False`.",
        "",
        "| method | exchange | step s | step vs fp32 DDP | MB across the link per step | fewer bytes across than fp32 "
        "DDP | MB within the node per step (counted) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in methods.items():
        exchange = "dense, flat" if method == "fp32" else ("hierarchical" if r.get("hierarchical") else "flat")
        within = r.get("counted_intra_node_bytes_per_step")
        peer = method == "fp32"  # the reference: its own ratios are 1 by definition
        lines.append(
            f"| {_label(results, method.removesuffix('_flat'))} | {exchange} | {sig(r['step_s'])} | "
            f"{'-' if peer else times(r['speedup_vs_fp32'])} | {sig(r['wire_bytes_per_step'] / 1e6)} | "
            f"{'-' if peer else times(r['wire_ratio_vs_fp32'])} | {'-' if within is None else sig(within / 1e6)} |"
        )
    quality = results["figures"].get("quality", {})
    if quality.get("methods"):
        q = quality["methods"]
        seeds = len(q["fp32"]["values"])
        lines += [
            "",
            f"Quality at 2 x 2 ranks over loopback (it does not depend on the link): the CNN's test accuracy after "
            f"{quality['steps']} steps, mean of {seeds} seeds (min..max), against dense fp32 DDP on the same 4 ranks.",
            "",
            "| method | exchange | test accuracy | vs fp32 DDP |",
            "|---|---|---|---|",
        ]
        for method, v in q.items():
            exchange = "dense, flat" if method == "fp32" else ("flat" if method.endswith("_flat") else "hierarchical")
            spread = f"{100 * min(v['values']):.2f}..{100 * max(v['values']):.2f}%"
            lines.append(
                f"| {_label(results, method.removesuffix('_flat'))} | {exchange} | {100 * v['mean']:.2f}% ({spread}) | "
                f"{'-' if method == 'fp32' else points(v['acc_points_vs_fp32'])} |"
            )
    return "\n".join(lines)


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``compression`` figure block (docs/compression.md), from ``results/compression.json``: per link rate
    and model, the step-time speed-up of every method over torch's fp16 hook (methods that failed say so), the
    fp16 hook's step, communication fraction and Amdahl bound, the rounds each median is over; then the bytes
    sent as ratios to the fp32 all-reduce: counted by the strategy, analytic, and off the interface's counter."""
    from benchmarks.common import count, load_results, measured_line, sig, times

    results = load_results(results_dir, "compression.json")
    f = results["figures"]
    lines = [measured_line(results, "compression.json", results_dir), ""]
    links = f.get("links") or {}
    if "skipped" in links or not links:
        return "\n".join([*lines, f"No link figures in this file (skipped: {links.get('skipped', 'not run')})."])
    lines += [
        "Two network namespaces joined by a veth pair shaped with `tc tbf`, one rank in each, gloo over that link; "
        "one CPU thread per rank. Step-time speed-up over torch's `fp16_compress_hook` (> 1: faster); the fp16 "
        "hook's column gives its step, the fraction of it spent communicating (1 - compute-only step / step) and "
        "its Amdahl bound (fp16-hook step / compute-only step).",
        "",
    ]
    models = list(dict.fromkeys(m for per_rate in links.values() for m in per_rate))
    for model in models:
        methods = list(
            dict.fromkeys(m for per_rate in links.values() for m in per_rate.get(model, {}).get("methods", {}))
        )
        others = [m for m in methods if m != "torch_fp16"]
        first = next(per_rate[model] for per_rate in links.values() if model in per_rate)
        params = next((r["params"] for r in first["methods"].values() if "params" in r), None)
        size = f", {count(params)} parameters" if params else ""
        lines += [
            f"{model}{size}; alternating rounds per median: {_rounds(results, first['methods'])}; compute-only step "
            f"{sig(f['compute_step_s'][model])} s:"
            if model in f.get("compute_step_s", {})
            else f"{model}{size}:",
            "",
            "| link | fp16 hook: step s (comm. fraction, Amdahl bound) | "
            + " | ".join(_label(results, m) for m in others)
            + " |",
            "|---|---|" + "---|" * len(others),
        ]
        for rate, per_rate in links.items():
            if model not in per_rate:
                continue
            g = per_rate[model]
            ms = g["methods"]
            fp16 = ms["torch_fp16"]
            cells = [
                "failed" if "error" in ms.get(m, {}) else times(ms[m]["speedup_vs_torch_fp16"]) if m in ms else "-"
                for m in others
            ]
            lines.append(
                f"| {rate} | {sig(fp16['step_s'])} s ({sig(g['torch_fp16_comm_fraction'], 2)}, "
                f"{times(g['amdahl_bound_vs_torch_fp16'], 2)}) | " + " | ".join(cells) + " |"
            )
        lines.append("")
    lines += [
        "Bytes sent per step as a ratio to the fp32 all-reduce's (counted by the strategy / analytic / read off the "
        f"sending interface's tx counter, {next(iter(links))} link):",
        "",
        "| model | " + " | ".join(_label(results, m) for m in METHODS if m != "fp32" and _has_bytes(links, m)) + " |",
    ]
    shown = [m for m in METHODS if m != "fp32" and _has_bytes(links, m)]
    lines.append("|---|" + "---|" * len(shown))
    first_rate = next(iter(links.values()))
    for model in models:
        ms = first_rate.get(model, {}).get("methods", {})
        cells = []
        for m in shown:
            r = ms.get(m, {})
            parts = [times(r[k]) if k in r else "-" for k in ("counted_ratio", "analytic_ratio", "wire_ratio_vs_fp32")]
            cells.append("failed" if "error" in r else "-" if not r else " / ".join(parts))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _has_bytes(links: dict[str, Any], method: str) -> bool:
    return any(method in g.get("methods", {}) for per_rate in links.values() for g in per_rate.values())


def render_quality_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``compression-quality`` figure block (docs/compression.md), from ``results/compression.json``: per
    model, the quality after a fixed step budget of every method against dense fp32 (GPT: validation loss,
    relative; CNN: test accuracy, in points), over the seeds the file records for that model (their number
    and the spread of the values are rendered)."""
    from benchmarks.common import load_results, measured_line, percent, points, sig

    results = load_results(results_dir, "compression.json")
    quality = results["figures"].get("quality") or {}
    lines = [measured_line(results, "compression.json", results_dir), ""]
    if not quality:
        return "\n".join([*lines, "No quality figures in this file (the quality runs were skipped or not reached)."])
    methods = list(dict.fromkeys(m for q in quality.values() for m in q["methods"] if m != "fp32"))
    lines += [
        "Over loopback (both ranks on one host), the same seeds for every method; the change against dense fp32 "
        "DDP of the GPT's validation loss (relative) and of the CNN's test accuracy (points), after a fixed number "
        "of steps.",
        "",
        "| model, metric: steps, seeds (fp32) | " + " | ".join(_label(results, m) for m in methods) + " | spread |",
        "|---|" + "---|" * (len(methods) + 1),
    ]
    for model, q in quality.items():
        ms = q["methods"]
        n = len(q["seeds"])
        seeds = "1 seed" if n == 1 else f"mean of {n} seeds"
        gpt = "rel_val_loss_vs_fp32" in next(iter(ms.values()))
        metric = "val loss" if gpt else "test acc"
        cells = []
        for m in methods:
            if m not in ms:
                cells.append("-")
            elif gpt:
                cells.append(percent(ms[m]["rel_val_loss_vs_fp32"]))
            else:
                cells.append(points(ms[m]["acc_points_vs_fp32"]).replace(" pts", ""))
        spread = max(max(v["values"]) - min(v["values"]) for v in ms.values())
        spread_text = "-" if n == 1 else (f"{sig(spread, 2)}" if gpt else f"up to {sig(100 * spread, 2)} pts")
        unit = "" if gpt else ", points"
        lines.append(
            f"| {model}, {metric}{unit}: {q['steps']} steps, {seeds} ({sig(ms['fp32']['mean'])}) | "
            + " | ".join(cells)
            + f" | {spread_text} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
