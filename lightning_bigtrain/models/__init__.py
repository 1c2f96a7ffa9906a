"""Small reference LightningModules for the demo, tests, notebooks and benchmarks."""

from lightning_bigtrain.models.cnn import FashionCNN
from lightning_bigtrain.models.gpt import CharGPT

__all__ = ["CharGPT", "FashionCNN"]
