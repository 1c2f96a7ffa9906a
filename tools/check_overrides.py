"""Fail when a method of this package overrides a Lightning hook unmarked, or is marked ``@override`` and no longer
overrides anything (Lightning renamed or removed the hook, so ours would silently never run).

Run by ``make lint`` (``python -m tools.check_overrides``) and by ``tests/test_package.py``. mypy checks the
same marks in classes that subclass Lightning directly; this check also covers mixins (their methods join a
Lightning class only in the final class) and needs no type checker.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import Iterable

PACKAGE = "lightning_bigtrain"


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] in (PACKAGE, "tests", "__main__")


def _lightning_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "lightning"]


def package_classes() -> list[type]:
    """Every class defined in the package that has a Lightning class among its bases."""
    package = importlib.import_module(PACKAGE)
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{PACKAGE}."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module.__name__ and _lightning_bases(obj):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def override_problems(classes: Iterable[type]) -> list[str]:
    """For each class: methods defined by this package (the class or its package mixins) that override a Lightning
    attribute without ``@override``, and methods marked ``@override`` that override nothing Lightning has."""
    problems: set[str] = set()
    for cls in classes:
        lightning = _lightning_bases(cls)
        for owner in (c for c in cls.__mro__ if _ours(c)):
            for name, attr in vars(owner).items():
                func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
                if not inspect.isfunction(func) or (name.startswith("__") and name.endswith("__")):
                    continue
                if func.__module__.split(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning"):
                    continue  # a Lightning implementation assigned back on purpose (a grandparent's, over a parent's)
                in_lightning = any(name in vars(base) for base in lightning)
                marked = getattr(attr, "__override__", False) or getattr(func, "__override__", False)
                where = f"{owner.__module__}.{owner.__qualname__}.{name}"
                if in_lightning and not marked:
                    problems.add(f"{where} overrides Lightning's {name} (in {cls.__qualname__}): mark it @override")
                elif marked and not in_lightning and not _overrides_ours(owner, cls, name):
                    problems.add(
                        f"{where} is marked @override but no Lightning base of {cls.__qualname__} has {name!r}: "
                        "was the hook renamed or removed?"
                    )
    return sorted(problems)


def _overrides_ours(owner: type, cls: type, name: str) -> bool:
    """Whether ``name`` overrides a method of another class of this package further up ``cls``'s MRO."""
    mro = cls.__mro__
    return any(_ours(base) and name in vars(base) for base in mro[mro.index(owner) + 1 :])


def main() -> int:
    problems = override_problems(package_classes())
    for problem in problems:
        print(problem)
    print(f"check_overrides: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
