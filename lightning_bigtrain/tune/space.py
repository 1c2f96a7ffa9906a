"""The search space of ``bigtrain tune``: dotted paths into a ``bigtrain fit`` config, and what each may take.

A space is a mapping from a config path to a parameter spec::

    trainer.strategy:          {choices: [ddp, bigtrain_zero1, bigtrain_zero2]}
    model.init_args.lr:        {low: 1.0e-3, high: 3.0e-2, log: true}
    data.init_args.batch_size: {choices: [32, 64, 128]}
    model.init_args.channels:  {choices: {small: [16, 32, 64], default: [32, 64, 128]}}
    trainer.max_epochs:        {low: 1, high: 3}             # both ints: an integer parameter

``choices`` as a list holds plain values (str, int, float, bool, None); as a mapping it names each choice,
and the value may be anything a config holds (a list, a ``class_path`` block): Optuna samples the name.
``low``/``high`` give a float range (``log: true`` for a log scale, ``step`` for a grid), or an integer range
when both bounds are integers (``type: float`` makes such a range real-valued). Path segments that are
integers index lists (``trainer.callbacks.0.init_args.warmup_steps``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Parameter", "SearchSpace", "get_path", "set_path"]

_PLAIN = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Parameter:
    """One searched config path: categorical (``choices``: name -> value) or a numeric range."""

    path: str
    choices: dict[str, Any] | None = None
    named: bool = False
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    integer: bool = False

    def suggest(self, trial: Any) -> Any:
        """The value for ``trial`` (an ``optuna.Trial`` or a ``FixedTrial``), sampled under ``self.path``."""
        if self.choices is not None:
            if not self.named:
                return trial.suggest_categorical(self.path, list(self.choices.values()))
            picked = trial.suggest_categorical(self.path, list(self.choices))
            return copy.deepcopy(self.choices[picked])
        assert self.low is not None and self.high is not None
        if self.integer:
            return trial.suggest_int(self.path, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.path, float(self.low), float(self.high), step=self.step, log=self.log)

    def value_of(self, sampled: Any) -> Any:
        """The config value for an Optuna parameter value (the choice's name -> its value)."""
        return copy.deepcopy(self.choices[sampled]) if self.choices is not None and self.named else sampled


def _parameter(path: str, spec: Any) -> Parameter:
    where = f"`space.{path}`"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: give a mapping, `{{choices: [...]}}` or `{{low: ..., high: ...}}`, not {spec!r}.")
    known = {"choices", "low", "high", "log", "step", "type"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a parameter takes {sorted(known)}.")
    if "choices" in spec:
        if set(spec) - {"choices"}:
            raise ValueError(f"{where}: `choices` stands alone (no low/high/log/step/type with it).")
        raw = spec["choices"]
        if isinstance(raw, Mapping):
            choices = {str(k): v for k, v in raw.items()}
        elif isinstance(raw, list):
            bad = [c for c in raw if not isinstance(c, _PLAIN)]
            if bad:
                raise ValueError(
                    f"{where}: list choices must be plain values (str, int, float, bool, null); {bad[0]!r} is not. "
                    "Name structured choices with a mapping: `choices: {name: value, ...}`."
                )
            choices = {}
            for c in raw:
                key = c if isinstance(c, str) else repr(c)
                if key in choices:
                    raise ValueError(f"{where}: choice {c!r} is given twice.")
                choices[key] = c
        else:
            raise ValueError(f"{where}: `choices` must be a list or a mapping, not {type(raw).__name__}.")
        if len(choices) < 1:
            raise ValueError(f"{where}: give at least one choice.")
        return Parameter(path=path, choices=choices, named=isinstance(raw, Mapping))
    if "low" not in spec or "high" not in spec:
        raise ValueError(f"{where}: a range needs both `low` and `high` (or give `choices`).")
    low, high = spec["low"], spec["high"]
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: `{name}` must be a finite number, not {v!r}.")
    if low > high:
        raise ValueError(f"{where}: `low` ({low}) is above `high` ({high}).")
    kind = spec.get("type")
    if kind not in (None, "int", "float"):
        raise ValueError(f"{where}: `type` is `int` or `float`, not {kind!r}.")
    integer = kind == "int" or (kind is None and isinstance(low, int) and isinstance(high, int))
    if integer and (low != int(low) or high != int(high)):
        raise ValueError(f"{where}: an integer range needs integer bounds, got {low!r}..{high!r}.")
    log = bool(spec.get("log", False))
    if log and low <= 0:
        raise ValueError(f"{where}: a log-scale range needs `low` > 0, got {low!r}.")
    step = spec.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0):
        raise ValueError(f"{where}: `step` must be a positive number, not {step!r}.")
    if step is not None and log:
        raise ValueError(f"{where}: Optuna takes `step` or `log`, not both.")
    return Parameter(path=path, low=low, high=high, log=log, step=step, integer=integer)


class SearchSpace:
    """The parameters of a study, validated against the base config they will be written into.

    Args:
        spec: ``{config path: parameter spec}`` (see the module's docstring).
        base: The ``bigtrain fit`` config (a mapping) every trial starts from; each path must reach into it
            (its last segment may be new, e.g. an ``init_args`` key left at the class default).
    """

    def __init__(self, spec: Mapping[str, Any], base: Mapping[str, Any]) -> None:
        if not isinstance(spec, Mapping) or not spec:
            raise ValueError(
                "`space`: give at least one parameter, e.g. `model.init_args.lr: {low: 1e-4, high: 1e-2}`."
            )
        self.parameters = [_parameter(str(path), s) for path, s in spec.items()]
        probe = copy.deepcopy(dict(base))
        for p in self.parameters:
            set_path(probe, p.path, None, what=f"`space.{p.path}`")

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample every parameter for ``trial``: ``{path: config value}``."""
        return {p.path: p.suggest(trial) for p in self.parameters}

    def values_of(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Config values for a finished trial's Optuna ``params``."""
        by_path = {p.path: p for p in self.parameters}
        return {path: by_path[path].value_of(v) for path, v in params.items() if path in by_path}

    def apply(self, config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``config`` with each ``{path: value}`` written in."""
        return self.apply_values(config, values)

    @staticmethod
    def apply_values(config: Mapping[str, Any], values: Mapping[str, Any], what: str | None = None) -> dict[str, Any]:
        """A copy of ``config`` with each ``{path: value}`` written in (errors name ``what.<path>``)."""
        out = copy.deepcopy(dict(config))
        for path, value in values.items():
            set_path(out, str(path), copy.deepcopy(value), what=None if what is None else f"`{what}.{path}`")
        return out


def _segments(path: str) -> list[str]:
    parts = path.split(".")
    if not path or any(not s for s in parts):
        raise ValueError(f"config path {path!r}: give dot-separated keys, e.g. `model.init_args.lr`.")
    return parts


def get_path(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in ``config`` (KeyError if absent)."""
    node = config
    for seg in _segments(path):
        node = node[int(seg)] if isinstance(node, list) else node[seg]
    return node


def set_path(config: dict[str, Any], path: str, value: Any, what: str | None = None) -> None:
    """Write ``value`` at dotted ``path``; every segment but the last must already exist."""
    parts = _segments(path)
    where = what or f"config path `{path}`"
    node: Any = config
    for i, seg in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not seg.isdigit() or int(seg) >= len(node):
                raise ValueError(f"{where}: `{here}` indexes a list of {len(node)} item(s); give 0..{len(node) - 1}.")
            node = node[int(seg)]
        elif isinstance(node, dict):
            if seg not in node:
                if seg == "init_args":  # a class given by class_path with every argument at its default
                    node[seg] = {}
                else:
                    keys = ", ".join(sorted(map(str, node))) or "nothing"
                    raise ValueError(f"{where}: the base config has no `{here}` (it holds {keys} there).")
            node = node[seg]
        else:
            raise ValueError(f"{where}: `{here}` is a {type(node).__name__}, not a section to write into.")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"{where}: `{path}` indexes a list of {len(node)} item(s).")
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"{where}: the parent of `{last}` is a {type(node).__name__}, not a section.")
