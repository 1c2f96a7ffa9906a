"""The prepared device check (benchmarks/gpu_check.py): its CPU dry run passes and covers every strategy, plugin,
compressor and callback; a perturbed result fails its check; the tolerances it uses are the ones it documents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import benchmarks.gpu_check as gpu_check
from benchmarks.gpu_check import CHECKS, KERNEL_CHECKS, SUBJECTS, TOLERANCES, Result, compare, exit_status
from lightning_bigtrain.compression import COMPRESSION_NAMES

ROOT = Path(__file__).resolve().parents[2]


def _expected_subjects() -> set[str]:
    """Every compressor name the package accepts, every ZeRO stage on both engines, both BF16 compensations and the
    three callbacks, from the package itself (a new compressor must get its checks)."""
    compressors = set(COMPRESSION_NAMES)
    return (
        {f"compress_{c}" for c in compressors}
        | {f"ddp_{c}" for c in compressors}
        | {f"zero{s}" for s in (1, 2, 3)}
        | {"zero1_bf16mixed", "zero2_bf16mixed", "zero2_fp16mixed"}
        | {f"deepspeed{s}" for s in (1, 2, 3)}
        | {"bf16_kahan", "bf16_stochastic", "fusion", "kd", "pruning"}
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.exists(), f"no report written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def test_the_dry_run_passes_every_check_of_every_subject(dry_run):
    proc, report = dry_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert (report["mode"], report["backend"], report["world_size"]) == ("dry-run", "gloo", 1)
    statuses: dict[str, dict[str, str]] = {}
    for r in report["results"]:
        statuses.setdefault(r["subject"], {})[r["check"]] = r["status"]
    assert set(statuses) == set(report["subjects"]) == set(SUBJECTS) == _expected_subjects()
    for subject, checks in statuses.items():
        wanted = KERNEL_CHECKS if subject.startswith("compress_") else CHECKS
        assert checks == dict.fromkeys(wanted, "PASS"), (subject, checks)
    # One printed line per check, in the documented form.
    lines = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert lines == [f"{r['status']} {r['name']} {r['detail']}" for r in report["results"]]


def test_the_report_names_each_class_it_exercised(dry_run):
    subjects = dry_run[1]["subjects"]
    assert subjects["zero2"] == "ZeroStrategy(stage=2)"
    assert subjects["deepspeed3"] == "DeepSpeedZeroStrategy(stage=3)"
    assert subjects["ddp_int4"] == "CompressedDDPStrategy('int4')"
    assert subjects["bf16_stochastic"] == "BF16Precision('stochastic')"
    assert subjects["compress_topk"].startswith("TopK(ratio=0.01")


def test_a_perturbed_result_fails_its_check():
    weights = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert compare("zero1.resume", weights.clone(), weights).status == "PASS"
    nudged = weights.clone()
    nudged[17] += 1e-3  # one weight of a resumed run off by 1e-3
    failed = compare("zero1.resume", nudged, weights, atol=1e-5, what="weights max|diff|")
    assert failed.status == "FAIL" and failed.detail == "weights max|diff|=0.001 (tol 1e-05)"
    assert compare("zero1.resume", nudged, weights, atol=2e-3).status == "PASS"
    losses = [4.5, 4.25, 4.0]
    assert compare("zero1.parity", [4.5, 4.25, 4.0 * (1 + 1e-6)], losses, rtol=1e-5).status == "PASS"
    assert compare("zero1.parity", [4.5, 4.25, 4.0 * (1 + 1e-4)], losses, rtol=1e-5).status == "FAIL"
    assert compare("kd.parity", [float("nan")], [1.0], atol=1.0).status == "FAIL"  # non-finite never passes
    assert compare("zero1.bytes", [1, 2], [1, 2, 3]).status == "FAIL"  # a missing value is not a match
    assert exit_status([Result("zero1.parity", "PASS", ""), failed]) == 1
    assert exit_status([Result("zero1.parity", "PASS", ""), Result("deepspeed1.bytes", "SKIP", "")]) == 0


def _short(x: float) -> str:
    """How the docstring writes a tolerance: 0, 1, 1e-5, 2e-2."""
    if x == 0 or x >= 1:
        return f"{x:g}"
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def test_every_tolerance_is_the_one_the_docstring_states():
    doc = " ".join((gpu_check.__doc__ or "").split())
    for key, tol in TOLERANCES.items():
        at = doc.rfind(f"``{key}``")  # the last mention: where the tolerance is tagged with its key
        assert at >= 0, f"the docstring does not state the tolerance {key!r}"
        near = doc[max(0, at - 120) : at + 160]
        assert f"{_short(tol.cpu)} / {_short(tol.cuda)}" in near, (key, tol, near)


def test_a_check_that_raises_is_reported_as_failed_not_dropped(monkeypatch):
    def broken(ctx: Any) -> list[Result]:
        raise RuntimeError("NCCL error: unhandled cuda error")

    monkeypatch.setattr(gpu_check, "_plan_of_checks", lambda: [("zero1", broken, CHECKS)])
    ctx = gpu_check.Context(torch.device("cpu"), gpu_check.DRY_RUN_SIZES, None, "unused")
    lines: list[str] = []
    results = gpu_check.run_checks(ctx, echo=lines.append)
    assert [r.name for r in results] == ["zero1.parity", "zero1.bytes", "zero1.resume"]
    assert all(r.status == "FAIL" and "RuntimeError: NCCL error" in r.detail for r in results)
    assert lines == [r.line() for r in results] and exit_status(results) == 1
