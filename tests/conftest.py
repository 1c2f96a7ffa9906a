"""Test configuration: GPU skips, small real-data fixtures, quiet Lightning."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
warnings.filterwarnings("ignore", category=DeprecationWarning)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fashion_subset():
    """Fashion-MNIST with 1024 samples per split, batch 32 (real data, set up by `make data`)."""
    from lightning_bigtrain.data import FashionMNISTDataModule

    return FashionMNISTDataModule(batch_size=32, subset=1024)


@pytest.fixture
def shakespeare_subset():
    """Shakespeare with 128 windows of 32 characters per split, batch 16."""
    from lightning_bigtrain.data import ShakespeareDataModule

    return ShakespeareDataModule(block_size=32, batch_size=16, subset=128)
