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


# The longest test files (minutes each on the 2-core CI host), longest first. `make test` hands whole files to two
# workers in collection order (`--dist loadfile --no-loadscope-reorder`): started first, they are spread over both
# workers and the short files fill in behind them, instead of one of them starting last and running alone.
_LONGEST_FIRST = (
    "tests/test_chaos_integration.py",
    "tests/test_notebooks.py",
    "tests/test_settings_integration.py",
    "tests/tune/test_ray_backend.py",
    "tests/tune/test_tune.py",
    "tests/test_cli.py",
    "tests/strategies/test_pipeline_integration.py",
    "tests/test_conformance_integration.py",
    "tests/strategies/test_tensor_parallel_integration.py",
)


def _file_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_file_rank)  # stable: each file's own order, and the other files', are kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def in_process_fit():
    """For fits run in the test process (one rank): its process group, environment (MASTER_PORT, which later
    subprocess launches would inherit and find taken) and deterministic flag are put back afterwards."""
    env, deterministic = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.use_deterministic_algorithms(deterministic)


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


@pytest.fixture
def s3_bucket(monkeypatch):
    """A real S3-compatible HTTP server (moto's) on a free local port, with a new empty bucket; the ranks
    reach it through s3fs, configured by the standard AWS environment variables they inherit. Yields the
    filesystem and the bucket's name (moto keeps buckets per process, so each test makes its own)."""
    import uuid

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "bigtrain",
        "AWS_SECRET_ACCESS_KEY": "bigtrain",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        monkeypatch.setenv(key, value)  # fmt: skip
    import fsspec
    import s3fs

    # fsspec caches filesystem instances by their arguments, not by the environment: an instance made
    # for an earlier test's server (now stopped) would be handed to the library's own calls here.
    s3fs.S3FileSystem.clear_instance_cache()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"checkpoints-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    yield fs, bucket
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()
