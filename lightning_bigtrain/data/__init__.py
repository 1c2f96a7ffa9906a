"""Real datasets as LightningDataModules, offline once `make data` has set them up; sharded datasets streamed
from object stores."""

from lightning_bigtrain.data.fashion_mnist import CLASSES, FashionMNISTDataModule, load_fashion_mnist
from lightning_bigtrain.data.paths import MissingDataError, data_root
from lightning_bigtrain.data.shakespeare import VOCAB, CharVocab, ShakespeareDataModule, load_corpus
from lightning_bigtrain.data.streaming import StreamingDataset, StreamingSampler, streaming_loader, write_shards

__all__ = [
    "CLASSES",
    "VOCAB",
    "CharVocab",
    "FashionMNISTDataModule",
    "MissingDataError",
    "ShakespeareDataModule",
    "StreamingDataset",
    "StreamingSampler",
    "data_root",
    "load_corpus",
    "load_fashion_mnist",
    "streaming_loader",
    "write_shards",
]
