"""The public package: lazy subpackages, fast import, the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning_bigtrain as bt


def test_subpackages_are_reachable_from_the_top():
    assert bt.callbacks.RunReport is not None
    assert bt.data.ShakespeareDataModule.vocab_size == 96
    assert bt.models.CharGPT is not None and bt.functional.model_state_bytes is not None
    assert issubclass(bt.warnings.NoEffectWarning, bt.warnings.BigtrainWarning)
    assert set(bt.__all__) >= {"callbacks", "data", "models", "functional", "strategies", "warnings"}


def test_heavy_optional_engines_are_not_imported_by_the_package():
    code = "import sys, lightning_bigtrain as bt; import lightning_bigtrain.cli; assert 'deepspeed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_warn_once_warns_once_per_message():
    from lightning_bigtrain.warnings import NoEffectWarning, warn_once

    with pytest.warns(NoEffectWarning, match="has no effect here"):
        assert warn_once("x has no effect here", NoEffectWarning)
    assert not warn_once("x has no effect here", NoEffectWarning)
