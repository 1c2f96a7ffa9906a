"""Skip markers for GPU tests and optional dependencies."""

from __future__ import annotations

import importlib.util

import pytest
import torch

__all__ = ["gpu", "requires"]

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module in ``modules`` can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")
