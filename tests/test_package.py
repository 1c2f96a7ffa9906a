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


def test_every_lightning_override_is_marked_and_still_overrides():
    """``make lint`` runs the same check: an unmarked override, or a marked method whose Lightning hook is gone
    (renamed upstream, so ours would never be called), is reported."""
    from tools.check_overrides import override_problems, package_classes

    assert override_problems(package_classes()) == []


def test_a_renamed_hook_fails_the_override_check():
    import lightning as L
    from typing_extensions import override

    from tools.check_overrides import override_problems

    class Renamed(L.Callback):
        @override
        def on_train_batch_strat(self, *args: object) -> None:  # a hook Lightning does not have
            pass

        def on_train_end(self, *args: object) -> None:  # an override without the mark
            pass

    problems = override_problems([Renamed])
    assert any("on_train_batch_strat is marked @override but no Lightning base" in p for p in problems), problems
    assert any("on_train_end overrides Lightning's on_train_end" in p for p in problems), problems


def test_installed_lightning_is_in_the_declared_range_and_the_compat_names_resolve():
    """CI installs the newest Lightning ``setup.cfg`` allows; the private names we use exist in it."""
    import configparser
    from pathlib import Path

    import lightning
    from packaging.requirements import Requirement

    import lightning_bigtrain._compat as compat

    config = configparser.ConfigParser()
    config.read(Path(__file__).parents[1] / "setup.cfg")
    requires = [Requirement(r) for r in config["options"]["install_requires"].split("\n") if r.strip()]
    spec = next(r.specifier for r in requires if r.name == "lightning")
    assert any(s.operator == "<" for s in spec), "setup.cfg must bound lightning from above"
    assert lightning.__version__ in spec, (lightning.__version__, str(spec))
    assert all(getattr(compat, name) is not None for name in compat.__all__ if name != "StrategyMixinBase")


def test_functional_and_engines_do_not_import_lightning_or_the_upper_layers():
    """docs/architecture.md's layer rule: functional (stateless) and engines (stateful) build on torch only."""
    import ast
    from pathlib import Path

    root = Path(bt.__file__).parent
    bad = []
    for folder in ("functional", "engines"):
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[:2]
                    if top[0] == "lightning" or (
                        top[0] == "lightning_bigtrain"
                        and top[1:]
                        and top[1] in ("strategies", "callbacks", "plugins", "cli", "demo")
                    ):
                        bad.append(f"{path.relative_to(root)} imports {name}")
    assert not bad, bad
