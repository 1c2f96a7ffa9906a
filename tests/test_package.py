"""The public package: lazy subpackages, fast import, the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning_bigtrain as bt


def test_import_is_light():
    code = (
        "import sys, lightning_bigtrain as bt; "
        "heavy = [m for m in ('torch', 'lightning', 'deepspeed') if m in sys.modules]; "
        "print(heavy); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_subpackages_are_reachable_from_the_top():
    assert bt.callbacks.RunReport is not None
    assert bt.data.ShakespeareDataModule.vocab_size == 96
    assert bt.models.CharGPT is not None and bt.functional.model_state_bytes is not None
    assert issubclass(bt.warnings.NoEffectWarning, bt.warnings.BigtrainWarning)
    assert set(dir(bt)) >= {"callbacks", "data", "models", "functional", "warnings", "cli"}


def test_deepspeed_is_not_imported_by_the_package():
    code = (
        "import sys, lightning_bigtrain as bt; bt.callbacks; bt.data; bt.models; bt.cli; "
        "assert 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        bt.nope  # noqa: B018


def test_warn_once_warns_once_per_message():
    from lightning_bigtrain.warnings import NoEffectWarning, warn_once

    with pytest.warns(NoEffectWarning, match="has no effect here"):
        assert warn_once("x has no effect here", NoEffectWarning)
    assert not warn_once("x has no effect here", NoEffectWarning)
