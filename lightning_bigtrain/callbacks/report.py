"""RunReport: what a run did, in one table: losses, throughput, memory per rank, and the parts in use."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_bigtrain.functional.memory import model_state_bytes, peak_memory_bytes

__all__ = ["RunReport", "format_report"]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(batch, dict):
        for item in batch.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _loss_of(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    return None


class RunReport(Callback):
    """Collects a report of a fit: train/val loss at start and end, throughput, memory per rank.

    Throughput is counted over all ranks, after ``warmup_steps`` batches (start-up and first-call costs
    excluded). Tokens are counted when the batch's first tensor holds integer ids (batch x time); samples
    always. Memory is the CUDA allocator's peak on GPUs and the process' peak RSS on CPU, per rank;
    model-state bytes (parameters, gradients, optimizer states) are taken before the second optimizer step
    (optimizers create their states in the first).
    The starting validation loss is one measured before the first optimizer step (``trainer.validate``
    before ``fit``, or a validation at step 0); the final one is the last measured after training began.

    Hooks: ``on_train_start``, ``on_train_batch_start``/``_end``, ``on_before_optimizer_step``,
    ``on_validation_epoch_end``, ``on_train_end`` (gathers across ranks; rank 0 writes ``path``).

    Args:
        path: Where rank 0 writes the report as Markdown (a ``.json`` twin is written beside it).
        title: Heading of the report.
        monitor: The logged validation metric to report.
        warmup_steps: Batches left out of the throughput window.
        verbose: Print the report on rank 0 when training ends.
    """

    def __init__(
        self,
        path: str | None = None,
        title: str = "lightning_bigtrain run report",
        monitor: str = "val_loss",
        warmup_steps: int = 2,
        verbose: bool = True,
    ) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`RunReport(warmup_steps={warmup_steps!r})`: warmup_steps must be an int >= 0.")
        if path is not None and not str(path).endswith(".md"):
            raise ValueError(f"`RunReport(path={path!r})`: the report is Markdown; give a path ending in `.md`.")
        self.path = path
        self.title = title
        self.monitor = monitor
        self.warmup_steps = warmup_steps
        self.verbose = verbose
        self.report: dict[str, Any] = {}
        self._val_losses: list[tuple[int, float]] = []
        self._reset_train()

    def _reset_train(self) -> None:
        self._batches = 0
        self._samples = 0
        self._tokens = 0
        self._t0: float | None = None
        self._first_loss: float | None = None
        self._last_loss: torch.Tensor | None = None
        self._state_bytes: dict[str, int] | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset_train()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batches == self.warmup_steps:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = _loss_of(outputs)
        if loss is not None:
            if self._first_loss is None:
                self._first_loss = float(loss.detach())
            self._last_loss = loss.detach()
        if self._t0 is not None:
            x = _first_tensor(batch)
            if x is not None and x.ndim > 0:
                self._samples += int(x.shape[0])
                if not x.is_floating_point() and x.ndim == 2:
                    self._tokens += x.numel()
        self._batches += 1

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The second step: optimizer states are created lazily by the first one.
        if self._state_bytes is None and trainer.global_step >= 1:
            self._state_bytes = self._count(trainer, pl_module, optimizer)

    @staticmethod
    def _count(trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> dict[str, int]:
        """Model-state bytes: the strategy's own count where it keeps states the module does not show
        (DeepSpeed's engine: flat fp32 partitions, gradient buffers), else the module's and optimizer's; plus a
        gradient compressor's per-rank state (error feedback, PowerSGD factors) as ``"compression"``."""
        own = getattr(trainer.strategy, "model_state_bytes", None)
        state = own() if callable(own) else model_state_bytes(pl_module, optimizer)
        engine = getattr(trainer.strategy, "compression_engine", None)
        if engine is not None:
            state = {**state, "compression": engine.state_bytes()}
            state["total"] += state["compression"]
        return state

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self._val_losses.append((trainer.global_step, float(value)))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        if self._state_bytes is None and trainer.optimizers:
            # A one-step run never reached a second step: count what is held now.
            self._state_bytes = self._count(trainer, pl_module, trainer.optimizers[0])
        state = self._state_bytes or {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
        local = torch.tensor(
            [elapsed, self._samples, self._tokens, peak_memory_bytes(device), state["total"]],
            dtype=torch.float64,
            device=device,
        )
        gathered = trainer.strategy.all_gather(local).reshape(-1, local.numel()).cpu()
        seconds = float(gathered[:, 0].max())
        samples, tokens = float(gathered[:, 1].sum()), float(gathered[:, 2].sum())
        self.report = {
            "title": self.title,
            "strategy": _describe(trainer.strategy),
            "precision": str(trainer.precision),
            "plugins": [type(trainer.strategy.precision_plugin).__name__],
            "callbacks": [type(c).__name__ for c in trainer.callbacks],  # type: ignore[attr-defined]
            "accelerator": type(trainer.accelerator).__name__,
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "train_loss_start": self._first_loss,
            "train_loss_end": float(self._last_loss) if self._last_loss is not None else None,
            "val_loss_start": next((v for step, v in self._val_losses if step == 0), None),
            "val_loss_end": next((v for step, v in reversed(self._val_losses) if step > 0), None),
            "timed_steps": max(0, self._batches - self.warmup_steps),
            "seconds": seconds,
            "samples_per_s": samples / seconds if seconds > 0 else None,
            "tokens_per_s": tokens / seconds if seconds > 0 and tokens > 0 else None,
            "memory_kind": "CUDA allocated (peak)" if device.type == "cuda" else "RSS (peak)",
            "peak_memory_bytes_per_rank": [int(v) for v in gathered[:, 3]],
            "model_state_bytes_per_rank": [int(v) for v in gathered[:, 4]],
        }
        if trainer.is_global_zero:
            metrics = {f"report/{k}": float(v) for k, v in self.report.items()
                       if k in ("samples_per_s", "tokens_per_s") and v is not None}  # fmt: skip
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            text = format_report(self.report)
            if self.path is not None:
                out = Path(self.path)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text)
                out.with_suffix(".json").write_text(json.dumps(self.report, indent=2))
            if self.verbose:
                print(text, flush=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"val_losses": list(self._val_losses)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._val_losses = [(int(step), float(v)) for step, v in state_dict.get("val_losses", [])]


def _describe(strategy: Any) -> str:
    args = []
    stage = getattr(strategy, "stage", None)
    if isinstance(stage, int):
        args.append(f"stage={stage}")
    degree = getattr(strategy, "tensor_parallel", 1)
    if isinstance(degree, int) and degree > 1:
        args.append(f"tensor_parallel={degree}")
    compression = getattr(strategy, "compression", None)
    if compression is not None:
        args.append(f"compression={compression!r}")
    return type(strategy).__name__ + (f"({', '.join(args)})" if args else "")


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(report: dict[str, Any]) -> str:
    """Render a :class:`RunReport` dictionary as a Markdown table."""
    rows = [
        ("strategy", report["strategy"]),
        ("precision", f"{report['precision']} ({', '.join(report['plugins'])})"),
        ("callbacks", ", ".join(report["callbacks"]) or "-"),
        ("accelerator x world size", f"{report['accelerator']} x {report['world_size']}"),
        ("optimizer steps", report["steps"]),
        ("train loss: first -> last step", f"{_fmt(report['train_loss_start'])} -> {_fmt(report['train_loss_end'])}"),
        ("val loss: start -> end", f"{_fmt(report['val_loss_start'])} -> {_fmt(report['val_loss_end'])}"),
        ("timed window", f"{report['timed_steps']} steps in {report['seconds']:.1f} s"),
        ("samples/s (all ranks)", _fmt(report["samples_per_s"], 1)),
        ("tokens/s (all ranks)", _fmt(report["tokens_per_s"], 0)),
        (f"peak memory per rank, {report['memory_kind']}",
         ", ".join(_mib(b) for b in report["peak_memory_bytes_per_rank"])),
        ("model states per rank (params+grads+optimizer)",
         ", ".join(_mib(b) for b in report["model_state_bytes_per_rank"])),
    ]  # fmt: skip
    lines = [f"# {report['title']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"
