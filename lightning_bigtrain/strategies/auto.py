"""``zero_strategy``: one call for either ZeRO engine, picked by
:func:`~lightning_bigtrain.strategies.options.resolve_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_bigtrain.functional.activation_checkpoint import ActivationCheckpointing
from lightning_bigtrain.functional.compression import Compressor
from lightning_bigtrain.strategies.deepspeed_zero import DeepSpeedZeroStrategy
from lightning_bigtrain.strategies.options import DeepSpeedOptions, Engine, ZeroOptions, resolve_engine
from lightning_bigtrain.strategies.zero import ZeroStrategy
from lightning_bigtrain.warnings import NoEffectWarning, warn_once

if TYPE_CHECKING:
    from lightning_bigtrain._compat import _StrategyRegistry

__all__ = ["register_auto", "zero_strategy"]


def zero_strategy(
    stage: int = 3,
    *,
    engine: Engine = "auto",
    offload_optimizer: bool = False,
    offload_params: bool = False,
    min_wrap_params: int | None = None,
    compression: Compressor | str | None = None,
    options: ZeroOptions | None = None,
    deepspeed: DeepSpeedOptions | None = None,
    activation_checkpointing: ActivationCheckpointing = False,
) -> ZeroStrategy | DeepSpeedZeroStrategy:
    """A ZeRO strategy on the engine ``engine`` names: :class:`ZeroStrategy` (``"torch"``) or
    :class:`DeepSpeedZeroStrategy` (``"deepspeed"``); ``"auto"`` takes DeepSpeed's engine when
    ``deepspeed=DeepSpeedOptions(...)`` is given (only it reads them), else the torch engine. Registered as
    ``bigtrain_auto_zero1/2/3``.

    Args:
        stage: ZeRO stage, 1, 2 or 3.
        engine: ``"torch"``, ``"deepspeed"`` or ``"auto"``.
        offload_optimizer: As in both classes.
        offload_params: As in both classes (stage 3).
        min_wrap_params: The torch engine's sharding-unit size (default 100,000 parameters); DeepSpeed's engine
            has no such knob and warns that it has no effect.
        compression: As in both classes (DeepSpeed's engine takes ``Cast`` only).
        options: :class:`ZeroOptions`.
        deepspeed: :class:`DeepSpeedOptions` (DeepSpeed's engine only; given to the torch engine, refused).
        activation_checkpointing: As in both classes: True (the repeated blocks) or the block classes.
    """
    common: dict[str, Any] = {
        "offload_optimizer": offload_optimizer,
        "offload_params": offload_params,
        "compression": compression,
        "options": options,
        "activation_checkpointing": activation_checkpointing,
    }
    if resolve_engine(engine, stage=stage, deepspeed=deepspeed) == "deepspeed":
        if min_wrap_params is not None:
            warn_once(
                "`zero_strategy(engine='deepspeed', min_wrap_params=...)` has no effect: DeepSpeed gathers stage 3 "
                "parameters per module (tune DeepSpeedOptions(prefetch_bucket_size=..., "
                "param_persistence_threshold=...) instead).",
                NoEffectWarning,
            )
        return DeepSpeedZeroStrategy(stage, deepspeed=deepspeed, **common)
    if deepspeed is not None:
        raise ValueError(
            "`zero_strategy(engine='torch', deepspeed=DeepSpeedOptions(...))`: DeepSpeed's knobs need "
            "engine='deepspeed' (or 'auto')."
        )
    if min_wrap_params is not None:
        common["min_wrap_params"] = min_wrap_params
    return ZeroStrategy(stage, **common)  # ZeroStrategy's own default otherwise, not a copy of it


def register_auto(registry: _StrategyRegistry) -> None:
    """``bigtrain_auto_zero1/2/3``: :func:`zero_strategy` with ``engine="auto"``."""
    for stage in (1, 2, 3):
        registry.register(
            f"bigtrain_auto_zero{stage}",
            zero_strategy,
            description=f"lightning_bigtrain ZeRO stage {stage}, engine chosen by zero_strategy(engine='auto')",
            override=True,
            stage=stage,
        )
