"""Real datasets as LightningDataModules, offline once `make data` has set them up."""

from lightning_bigtrain.data.fashion_mnist import CLASSES, FashionMNISTDataModule, load_fashion_mnist
from lightning_bigtrain.data.paths import MissingDataError, data_root
from lightning_bigtrain.data.shakespeare import VOCAB, CharVocab, ShakespeareDataModule, load_corpus

__all__ = [
    "CLASSES",
    "VOCAB",
    "CharVocab",
    "FashionMNISTDataModule",
    "MissingDataError",
    "ShakespeareDataModule",
    "data_root",
    "load_corpus",
    "load_fashion_mnist",
]
