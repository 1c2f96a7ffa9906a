"""Streaming Fashion-MNIST from a local S3-compatible server against reading it from local disk, in the same run.

    python -m benchmarks.data [--epochs 3] [--repeats 2] [--shard-bytes 4MiB] [--quick]

The training split of ``FashionMNISTDataModule`` (55,000 images, stored as uint8 and standardised per sample as the
datamodule does) is read for ``--epochs`` epochs, batch 256, shuffled, by a DataLoader with 2 worker processes
(persistent), one reader per process (each started fresh; the order of the readers alternates between repeats):

- ``files``: the datamodule's own dataset over the local IDX files (in memory), ``shuffle=True``;
- ``local_shards``: ``StreamingDataset`` over the shards ``write_shards`` wrote to a local folder;
- ``s3``: ``StreamingDataset`` over the same shards uploaded to moto's S3 server (started here, on this machine),
  an empty cache at the start (the first epoch downloads every shard; the next ones read the cache);
- ``litdata_s3`` (when litdata is installed): litdata's ``StreamingDataset``/``StreamingDataLoader`` over the
  same images written by ``litdata.optimize`` (same chunk size) to the same server, empty cache. litdata fetches
  chunks with obstore, whose client refuses plain ``http://`` endpoints unless told to allow them; this
  benchmark sets ``allow_http`` in litdata's obstore client options (module constant) in the reading process;
- ``litdata_s3_nobatch``: the same with ``batch_decode=False``: litdata's default (``"auto"``) decodes a run of
  neighbouring items of a chunk for each item it reads, which a shuffled read mostly throws away.

Figures: samples/s per epoch (the whole epoch from the first batch requested to the last one received, worker
start included in the first epoch); "first" is epoch 1, "steady" the median of the later epochs, each the median
over repeats. Target (issue 24): ``s3`` steady / ``local_shards`` steady >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, machine_info, print_table, run_worker, times, write_results

READERS = ("files", "local_shards", "s3", "litdata_s3", "litdata_s3_nobatch")
BATCH, WORKERS = 256, 2


def _litdata_available() -> bool:
    try:
        import litdata  # noqa: F401
    except ImportError:
        return False
    return True


class _Item:
    """litdata.optimize's fn: the stored training sample ``i`` (read lazily in each of its spawned workers)."""

    def __init__(self, subset: int | None) -> None:
        self.subset, self.raw = subset, None

    def __call__(self, i: int) -> Any:
        if self.raw is None:
            from lightning_bigtrain.data.fashion_mnist import raw_splits

            self.raw = raw_splits(None, 5000, 0, self.subset)["train"]
        return self.raw[i]


def _litdata_optimize(out: str, subset: int | None, chunk_bytes: str) -> None:
    """litdata.optimize in its own process (it switches multiprocessing to spawn for the process)."""
    import litdata

    n = subset or 55000
    litdata.optimize(fn=_Item(subset), inputs=list(range(n)), output_dir=out, chunk_bytes=chunk_bytes, num_workers=1)


def worker(reader: str, url: str, epochs: int, subset: int | None, out: str) -> None:
    import torch
    from torch.utils.data import DataLoader

    from lightning_bigtrain.data import FashionMNISTDataModule, StreamingDataset, streaming_loader
    from lightning_bigtrain.data.fashion_mnist import standardise

    torch.set_num_threads(1)
    cache = tempfile.mkdtemp(prefix="bigtrain-bench-cache-")
    loader: Any
    if reader == "files":
        dm = FashionMNISTDataModule(batch_size=BATCH, subset=subset, seed=0)
        dm.setup()
        loader = DataLoader(dm._splits["train"], batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                            persistent_workers=True)  # fmt: skip
    elif reader in ("local_shards", "s3"):
        loader = streaming_loader(StreamingDataset(url, transform=standardise, cache_dir=cache), BATCH, seed=0,
                                  num_workers=WORKERS)  # fmt: skip
    else:
        import litdata
        import litdata.streaming.downloader as downloader

        downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}  # type: ignore[attr-defined]
        ds = litdata.StreamingDataset(url, shuffle=True, seed=0, cache_dir=cache, transform=standardise,
                                      batch_decode="auto" if reader == "litdata_s3" else False)  # fmt: skip
        loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
    per_epoch = []
    samples = 0
    for epoch in range(epochs):
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        samples = 0
        for batch in loader:
            samples += len(batch[1])
        per_epoch.append(samples / (time.perf_counter() - t0))
        assert batch[0].dtype == torch.float32 and batch[0].shape[1:] == (1, 28, 28)
    Path(out).write_text(json.dumps({"samples_per_s": per_epoch, "samples": samples}))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shard-bytes", default="4MiB", help="shard (and litdata chunk) size")
    parser.add_argument("--quick", action="store_true", help="8192 samples, 2 epochs, 1 repeat (a smoke run)")
    parser.add_argument("--no-litdata", action="store_true", help="leave litdata out")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--subset", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--litdata-optimize", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.litdata_optimize:
        _litdata_optimize(args.litdata_optimize, args.subset, args.shard_bytes)
        return {}
    if args.worker:
        worker(args.worker, args.url, args.epochs, args.subset, args.out)
        return {}
    epochs, repeats = (2, 1) if args.quick else (args.epochs, args.repeats)
    if epochs < 2:
        parser.error("--epochs must be >= 2 (the first epoch is reported apart from the steady ones)")
    subset = 8192 if args.quick else None
    readers = [r for r in READERS if not r.startswith("litdata") or (not args.no_litdata and _litdata_available())]

    from moto.server import ThreadedMotoServer

    from lightning_bigtrain.data import write_shards
    from lightning_bigtrain.data.fashion_mnist import raw_splits

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bigtrain", AWS_SECRET_ACCESS_KEY="bigtrain", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")  # fmt: skip
    runs: dict[str, list[list[float]]] = {r: [] for r in readers}
    try:
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bigtrain-bench")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            index = write_shards(
                raw_splits(None, 5000, 0, subset)["train"], f"{tmp}/shards", shard_bytes=args.shard_bytes
            )
            write_s = time.perf_counter() - t0
            fs.put(f"{tmp}/shards/", "bigtrain-bench/shards/", recursive=True)
            urls = {"files": "-", "local_shards": f"{tmp}/shards", "s3": "s3://bigtrain-bench/shards"}
            if "litdata_s3" in readers:
                t0 = time.perf_counter()
                cmd = [sys.executable, "-m", "benchmarks.data", "--litdata-optimize", f"{tmp}/litdata",
                       "--shard-bytes", args.shard_bytes.replace("iB", "B")]  # fmt: skip
                subprocess.run(cmd + (["--subset", str(subset)] if subset else []), check=True, capture_output=True)
                litdata_write_s = time.perf_counter() - t0
                fs.put(f"{tmp}/litdata/", "bigtrain-bench/litdata/", recursive=True)
                urls["litdata_s3"] = urls["litdata_s3_nobatch"] = "s3://bigtrain-bench/litdata"
            for rep in range(repeats):
                for reader in readers if rep % 2 == 0 else readers[::-1]:
                    wargs = ["--worker", reader, "--url", urls[reader], "--epochs", str(epochs)]
                    r = run_worker("benchmarks.data", wargs + (["--subset", str(subset)] if subset else []))
                    runs[reader].append(r["samples_per_s"])
                    print(f"repeat {rep} {reader}: " + ", ".join(f"{s:.0f}" for s in r["samples_per_s"])
                          + " samples/s per epoch", flush=True)  # fmt: skip
    finally:
        server.stop()

    def first(reader: str) -> float:
        return statistics.median(run[0] for run in runs[reader])

    def steady(reader: str) -> float:
        return statistics.median(statistics.median(run[1:]) for run in runs[reader])

    figures: dict[str, Any] = {
        "samples": index["num_samples"], "shards": len(index["shards"]), "write_s": write_s,
        "readers": {r: {"runs": runs[r], "first": first(r), "steady": steady(r)} for r in readers},
        "s3_steady_vs_local_shards": steady("s3") / steady("local_shards"),
        "s3_first_vs_local_shards": first("s3") / steady("local_shards"),
        "s3_steady_vs_files": steady("s3") / steady("files"),
        "local_shards_vs_files": steady("local_shards") / steady("files"),
    }  # fmt: skip
    if "litdata_s3" in readers:
        figures["litdata_write_s"] = litdata_write_s
        best = max(("litdata_s3", "litdata_s3_nobatch"), key=steady)
        figures["litdata_best"] = best
        figures["s3_vs_litdata_steady"] = steady("s3") / steady(best)
        figures["s3_vs_litdata_first"] = first("s3") / first(best)
    rows = [{"reader": r, "first epoch samples/s": first(r), "steady samples/s": steady(r),
             "steady vs local shards": steady(r) / steady("local_shards")} for r in readers]  # fmt: skip
    print(f"\nFashion-MNIST train ({index['num_samples']} samples, {len(index['shards'])} shards), batch {BATCH}, "
          f"{WORKERS} workers, {epochs} epochs x {repeats} repeat(s)")  # fmt: skip
    figures["table"] = print_table(rows, list(rows[0]))
    headline = (f"S3 steady {figures['s3_steady_vs_local_shards']:.2f}x local shards (first epoch "
                f"{figures['s3_first_vs_local_shards']:.2f}x)"
                + (f"; {figures['s3_vs_litdata_steady']:.1f}x litdata's best" if "litdata_s3" in readers
                   else ""))  # fmt: skip
    config = {"quick": args.quick, "epochs": epochs, "repeats": repeats, "shard_bytes": args.shard_bytes,
              "batch_size": BATCH, "num_workers": WORKERS, "subset": subset}  # fmt: skip
    if "litdata_s3" in readers:
        import litdata

        config["litdata"] = litdata.__version__
    payload = {"config": config, "machine": machine_info(), "figures": figures}
    path = write_results("data", payload, headline, args.results_dir, command=command_line("benchmarks.data", argv))
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``data`` block (docs/data.md), from ``results/data.json``."""
    from benchmarks.common import load_results, measured_line

    results = load_results(results_dir, "data.json")
    f, c = results["figures"], results["config"]
    lines = [
        measured_line(results, "data.json", results_dir),
        "",
        f"Fashion-MNIST's training split ({f['samples']} samples in {f['shards']} shards of {c['shard_bytes']}), "
        f"shuffled, batch {c['batch_size']}, {c['num_workers']} loader workers, one process; samples/s over an "
        f"epoch, the first epoch apart (S3: an empty cache) from the steady ones (median), median of "
        f"{c['repeats']} repeat(s). S3 is moto's server on the same machine.",
        "",
        "| reader | first epoch, samples/s | steady, samples/s | steady vs local shards |",
        "|---|---|---|---|",
    ]
    labels = {"files": "the datamodule's local files (in memory)", "local_shards": "`StreamingDataset`, local shards",
              "s3": "`StreamingDataset`, `s3://` (cached after epoch 1)",
              "litdata_s3": f"litdata {c.get('litdata', '')} `StreamingDataset`, `s3://`",
              "litdata_s3_nobatch": f"litdata {c.get('litdata', '')}, `batch_decode=False`, `s3://`"}  # fmt: skip
    base = f["readers"]["local_shards"]["steady"]
    for reader, r in f["readers"].items():
        versus = "(the baseline)" if reader == "local_shards" else times(r["steady"] / base)
        lines.append(f"| {labels[reader]} | {r['first']:.0f} | {r['steady']:.0f} | {versus} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
