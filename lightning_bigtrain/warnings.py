"""Warning classes of lightning_bigtrain and a rank-zero, once-only way to raise them.

A setting that cannot take effect (a comm hook on a backend that drops it, a callback with nothing to
act on) is never ignored silently: it warns once, on global rank 0, with one of these classes, so users
can filter them with ``warnings.filterwarnings("error", category=bt.warnings.BigtrainWarning)``.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["BigtrainWarning", "NoEffectWarning", "warn_once"]


class BigtrainWarning(UserWarning):
    """Base class of every warning lightning_bigtrain raises."""


class NoEffectWarning(BigtrainWarning):
    """A setting was accepted but has no effect in this run (say why and how to make it act)."""


_seen: set[tuple[type[Warning], str]] = set()


def _global_rank() -> int:
    try:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank = getattr(rank_zero_only, "rank", None)
        if rank is not None:
            return int(rank)
    except ImportError:  # pragma: no cover - lightning is a hard dependency
        pass
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def warn_once(message: str, category: type[Warning] = BigtrainWarning, stacklevel: int = 2) -> bool:
    """Warn with ``message`` once per process, and only on global rank 0.

    Returns:
        True if the warning was emitted by this call.
    """
    key = (category, message)
    if key in _seen or _global_rank() != 0:
        return False
    _seen.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True
