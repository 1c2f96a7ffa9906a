"""What CompressedDDPStrategy and ZeroStrategy share about gradient compression: resolving the user's
``compression=`` argument, checkpointing each rank's compression state, and logging bytes per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_bigtrain._logging import is_logging_step, log_interval
from lightning_bigtrain.engines.auto_compression import AutoCompression
from lightning_bigtrain.engines.compression import GradientCompression
from lightning_bigtrain.functional.compression import COMPRESSION_NAMES, Cast, Compressor
from lightning_bigtrain.warnings import BigtrainWarning, NoEffectWarning, warn_once

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as Strategy

__all__ = ["CHECKPOINT_KEY", "COMPRESSION_NAMES", "CompressionSupport", "compression_applies", "resolve_compression"]

CHECKPOINT_KEY = "bigtrain_compression"


def resolve_compression(value: Compressor | str | None, owner: str) -> Compressor | None:
    """A compressor from a ``Compressor`` or one of :data:`COMPRESSION_NAMES` (and ``"auto"`` for
    ``CompressedDDPStrategy``); ``owner`` names the call."""
    if value == "auto" or isinstance(value, AutoCompression):
        if owner != "CompressedDDPStrategy":
            raise ValueError(
                f"`{owner}(compression={value!r})` is not supported: the timed choice of an exchange runs under "
                "CompressedDDPStrategy only. Pass a compressor (e.g. 'fp16', 'powersgd'), or use "
                "CompressedDDPStrategy(compression='auto')."
            )
        return AutoCompression() if value == "auto" else value  # type: ignore[return-value]
    if value is None or isinstance(value, Compressor):
        return value
    if isinstance(value, str) and value in COMPRESSION_NAMES:
        return COMPRESSION_NAMES[value]()
    raise ValueError(
        f"`{owner}(compression={value!r})` is not supported: pass a compressor from "
        "lightning_bigtrain.compression (PowerSGD, TopK, OneBit, Quantize, Cast) or one of "
        f"{', '.join(repr(k) for k in COMPRESSION_NAMES)}" + (", 'auto'." if owner == "CompressedDDPStrategy" else ".")
    )


def compression_applies(
    compressor: Compressor, module: torch.nn.Module, world_size: int, owner: str, shown: object = None
) -> bool:
    """Whether ``compressor`` can act in this run; if not, warn (:class:`NoEffectWarning`) and say why.

    It cannot with a single process (nothing is exchanged; compressing would only add error), nor as a
    ``Cast`` when the trainable parameters, hence their gradients, are 16-bit already (``"16-true"`` or
    ``"bf16-true"`` precision): the exchange then sends the same bytes, and fp16 <-> bf16 only loses range
    or mantissa. In both cases the strategy exchanges gradients as it would without compression.
    """
    if world_size < 2:
        what = compressor if shown is None else shown  # what the user passed (a OneBitAdam names itself)
        warn_once(
            f"`{owner}(compression={what!r})` has no effect in a single process: no gradients are "
            "exchanged, so none are compressed. It acts with devices * num_nodes >= 2.",
            NoEffectWarning,
        )
        return False
    if isinstance(compressor, Cast):
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad and p.is_floating_point()}
        if dtypes and all(d.itemsize <= 2 for d in dtypes):
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            warn_once(
                f"`{owner}(compression={compressor!r})` has no effect: the gradients are {names} already "
                "(a 16-bit 'true' precision), so they are exchanged as they are. Cast acts with "
                "precision='32-true' or a '-mixed' precision, whose gradients are fp32.",
                NoEffectWarning,
            )
            return False
    return True


def _layout(layout: list[int] | None) -> str:
    return "a flat exchange" if layout is None else f"a hierarchical exchange ({layout[0]} nodes x {layout[1]} ranks)"


class CompressionSupport:
    """Holds a strategy's :class:`GradientCompression` engine; saves, restores and logs it."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.engine: GradientCompression | None = None
        self._pending: dict[str, Any] | None = None
        self._logged = (0.0, 0.0, 0.0)

    def attach(self, engine: GradientCompression, global_rank: int) -> None:
        self.engine = engine
        if self._pending is not None:
            self._restore(self._pending, global_rank)
            self._pending = None

    def state_for_checkpoint(self, strategy: Strategy) -> dict[str, Any] | None:
        """Every rank's state (a collective: call it on every rank)."""
        if self.engine is None:
            return None
        states: list[Any] = [None] * strategy.world_size
        torch.distributed.all_gather_object(states, self.engine.state_dict())
        return {"world_size": strategy.world_size, "ranks": states}

    def load_from_checkpoint(self, checkpoint: dict[str, Any], global_rank: int) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            return
        if self.engine is None:
            self._pending = state
        else:
            self._restore(state, global_rank)

    def _restore(self, state: dict[str, Any], global_rank: int) -> None:
        assert self.engine is not None
        saved = state["ranks"][0]
        if saved["compressor"] != repr(self.compressor):
            warn_once(
                f"The checkpoint's gradient compression state was written for {saved['compressor']}, this run "
                f"uses {self.compressor!r}: error feedback and factors start afresh.",
                BigtrainWarning,
            )
            return
        if state["world_size"] != self.engine.global_world:
            warn_once(
                f"The checkpoint was written by {state['world_size']} ranks, this run has {self.engine.global_world}: "
                "per-rank error-feedback buffers are dropped (the run continues, not on the same trajectory).",
                BigtrainWarning,
            )
            self.engine.load_state_dict(saved, errors=False)
            return
        layout = None if self.engine.nodes is None else [self.engine.nodes.num_nodes, self.engine.nodes.local_world]
        if saved.get("layout") != layout:
            warn_once(
                f"The checkpoint's gradient compression state was written by {_layout(saved.get('layout'))}, this "
                f"run uses {_layout(layout)}: error-feedback buffers are dropped (they hold different residuals), "
                "factors and counters are kept.",
                BigtrainWarning,
            )
            self.engine.load_state_dict(saved, errors=False)
            return
        self.engine.load_state_dict(state["ranks"][global_rank])

    def after_step(self, strategy: Strategy) -> None:
        """Count the step; at the trainer's logging cadence log bytes per step and the compression ratio."""
        engine = self.engine
        if engine is None:
            return
        engine.advance()
        module = strategy.lightning_module
        if module is None or not strategy.is_global_zero:
            return
        trainer = module.trainer
        if not is_logging_step(trainer):
            return
        every = log_interval(trainer)
        sent = (engine.sent_bytes - self._logged[0]) / every
        dense = (engine.dense_bytes - self._logged[1]) / every
        intra = (engine.intra_bytes - self._logged[2]) / every
        self._logged = (engine.sent_bytes, engine.dense_bytes, engine.intra_bytes)
        metrics = {
            "compression/sent_bytes_per_step": sent,
            "compression/dense_bytes_per_step": dense,
            "compression/ratio": dense / sent if sent else float("nan"),
        }
        if engine.nodes is not None:  # sent_bytes are then the bytes across nodes
            metrics["compression/intra_node_bytes_per_step"] = intra
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
