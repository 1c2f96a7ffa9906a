"""``bigtrain data optimize SRC DST``: write a dataset as shards a :class:`~lightning_bigtrain.data.StreamingDataset`
streams from any fsspec URL.

``SRC`` is ``fashion-mnist`` or ``shakespeare`` (the bundled datamodules' train/val/test splits, as stored, under
``DST/train``, ``DST/val``, ``DST/test``; the datamodules read them back with ``streaming=DST``) or
``package.module:name``, a map-style dataset or a function of no arguments returning one (written to ``DST``).
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

__all__ = ["main", "optimize"]

SOURCES = ("fashion-mnist", "shakespeare")


def _bundled(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bundled datamodule's raw splits and the settings recorded with them."""
    if args.src == "fashion-mnist":
        from lightning_bigtrain.data.fashion_mnist import FashionMNISTDataModule, raw_splits

        dm: Any = FashionMNISTDataModule(data_dir=args.data_dir, val_size=args.val_size, seed=args.seed,
                                         subset=args.subset)  # fmt: skip
        return raw_splits(args.data_dir, dm.val_size, dm.seed, dm.subset), dm.stored_as()
    from lightning_bigtrain.data.shakespeare import ShakespeareDataModule
    from lightning_bigtrain.data.shakespeare import raw_splits as windows

    dm = ShakespeareDataModule(data_dir=args.data_dir, block_size=args.block_size, subset=args.subset)
    return windows(args.data_dir, dm.block_size, dm.val_fraction, dm.test_fraction, dm.subset), dm.stored_as()


def _imported(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"SRC {spec!r}: give one of {', '.join(SOURCES)} or `package.module:name`.")
    obj = getattr(importlib.import_module(module_name), attr)
    dataset = obj() if callable(obj) and not hasattr(obj, "__getitem__") else obj
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(f"SRC {spec!r} is a {type(dataset).__name__}, not a map-style dataset (len and [i]).")
    return dataset


def optimize(args: argparse.Namespace) -> list[str]:
    """Write ``args.src`` under ``args.dst``; the lines to print."""
    from lightning_bigtrain.data.streaming import write_shards

    dst = args.dst.rstrip("/")
    if args.src in SOURCES:
        splits, stored = _bundled(args)
        targets = [(f"{dst}/{name}", ds, stored) for name, ds in splits.items()]
    else:
        targets = [(dst, _imported(args.src), {"source": args.src})]
    lines = []
    for url, dataset, meta in targets:
        t0 = time.perf_counter()
        index = write_shards(dataset, url, shard_bytes=args.shard_bytes, meta=meta, overwrite=args.overwrite)
        size = sum(s["bytes"] for s in index["shards"])
        lines.append(f"{url}: {index['num_samples']} samples in {len(index['shards'])} shards, {size} bytes "
                     f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bigtrain data", description="Datasets as shards for streaming.")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="write a dataset as shards", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    opt.add_argument("src", help=f"{' | '.join(SOURCES)} | package.module:name")
    opt.add_argument("dst", help="where to write: a local folder or an fsspec URL (s3://bucket/prefix)")
    opt.add_argument("--shard-bytes", default="32MiB", help="target shard size (default 32MiB)")
    opt.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    opt.add_argument("--data-dir", default=None, help="bundled datasets: the data cache (default $BIGTRAIN_DATA)")
    opt.add_argument("--subset", type=int, default=None, help="bundled datasets: first N samples of each split")
    opt.add_argument("--val-size", type=int, default=5000, help="fashion-mnist: validation images")
    opt.add_argument("--seed", type=int, default=0, help="fashion-mnist: seed of the train/validation split")
    opt.add_argument("--block-size", type=int, default=128, help="shakespeare: characters per sample")
    args = parser.parse_args(argv)
    try:
        for line in optimize(args):
            print(line)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError, ImportError, AttributeError) as err:
        parser.error(str(err))
    return 0
