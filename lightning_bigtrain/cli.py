"""The ``bigtrain`` command: ``fit | validate | test | predict`` on LightningCLI, and ``demo``.

    bigtrain fit --config configs/demo.yaml --trainer.max_steps=20
    bigtrain fit --config configs/fault_tolerance.yaml --resume auto   # continue a killed or preempted run
    bigtrain demo --output runs/demo
    bigtrain consolidate runs/zero3/checkpoints/last.ckpt model.ckpt
    bigtrain plan --config configs/zero3.yaml --devices 8 --num-nodes 4 --device-memory 80GB
    bigtrain tune --config configs/tune.yaml --trials 20

Models and datamodules are given by ``class_path`` (any LightningModule / LightningDataModule);
lightning_bigtrain's strategies, callbacks and plugins are reachable by ``class_path`` and by their
registered strategy names.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

__all__ = ["BigtrainCLI", "main"]

# Strategy strings the accelerator connector accepts besides the registry's names.
_BUILTIN_STRATEGY_NAMES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "deepspeed", "single_device")


def _known_strategy_names() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted(set(StrategyRegistry.available_strategies()) | set(_BUILTIN_STRATEGY_NAMES))


def check_strategy_name(name: str) -> str | None:
    """An error message if ``name`` is not a strategy Lightning can resolve, else None."""
    known = _known_strategy_names()
    if name in known:
        return None
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"`trainer.strategy={name!r}` is not a known strategy name.{hint} "
        f"Registered names: {', '.join(known)}. A strategy class can also be given by `class_path`."
    )


class BigtrainCLI(LightningCLI):
    """LightningCLI for any LightningModule and LightningDataModule (``class_path`` in the config).

    Checks the strategy name before the Trainer is built, so a typo gets a suggestion rather than a
    stack trace. ``--resume auto`` (every subcommand accepts it; ``fit`` uses it) resumes from the newest
    committed checkpoint of the run's ``ModelCheckpoint`` folder, or starts fresh when there is none; an
    explicit ``--ckpt_path`` wins. A preempted run (SIGTERM/SIGUSR1) exits with status 75 after its
    checkpoint is committed: relaunch the same command.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault(
            "parser_kwargs",
            {"description": "lightning_bigtrain: fit/validate/test/predict any LightningModule. "
                            "Also: `bigtrain demo --help`, `bigtrain consolidate --help`, `bigtrain plan --help`, "
                            "`bigtrain tune --help`."},
        )  # fmt: skip
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--resume",
            choices=["auto", "never"],
            default="never",
            help="auto: continue from the newest committed checkpoint in the ModelCheckpoint folder (without a "
            "dirpath: the newest version folder of the logger that holds one, whose logs the run continues), or "
            "start fresh if there is none.",
        )

    @override
    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        config = self.config.get(subcommand, self.config)
        if subcommand == "fit" and config.get("resume") == "auto" and kwargs.get("ckpt_path") is None:
            kwargs["ckpt_path"] = resume_path(self.trainer)
        return kwargs

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        if isinstance(strategy, str):
            message = check_strategy_name(strategy)
            if message is not None:
                self.parser.error(message)


def resume_path(trainer: Any) -> str | None:
    """What ``--resume auto`` resumes from: the newest committed ``last*.ckpt`` (or, without one, the newest
    committed checkpoint) in the ModelCheckpoint folder. Without a ``dirpath`` that folder is the first logger's
    version folder (``TensorBoardLogger``/``CSVLogger``): the newest version folder holding a committed checkpoint,
    whose version the loggers then continue; ``"last"`` (Lightning's own lookup, which starts fresh with a warning
    when there is nothing) when the folder is only known once the run starts. When it resumes, a ``CSVLogger``
    continuing its folder keeps the log of the run it continues (see :mod:`lightning_bigtrain._resume_logs`)."""
    from lightning_bigtrain._resume_logs import keep_csv_history, newest_run_checkpoint
    from lightning_bigtrain.checkpointing import latest_checkpoint

    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    if dirpath is not None:
        path = latest_checkpoint(dirpath, prefer_prefix="last") or None
    else:
        known, path = newest_run_checkpoint(trainer) if callback is not None else (False, None)
        if not known:
            return "last"
    if path is not None and _fault_tolerant(trainer):
        keep_csv_history(trainer)
    return path


def _fault_tolerant(trainer: Any) -> bool:
    """Whether the fit continues the logs it resumes (this package's strategies, or ``FaultTolerance``)."""
    from lightning_bigtrain.callbacks import FaultTolerance
    from lightning_bigtrain.strategies._fault import FaultTolerantStrategyMixin

    return isinstance(trainer.strategy, FaultTolerantStrategyMixin) or any(
        isinstance(cb, FaultTolerance) for cb in trainer.callbacks
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bigtrain`` console script."""
    try:
        _main(argv)
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Destroy the default process group the run created, before the interpreter exits.

    Left to interpreter shutdown, the gloo context's worker threads can be destroyed while still joinable,
    which aborts the process (``terminate called without an active exception``, exit -6) after a run that
    finished correctly. Every collective of ``fit`` has completed on every rank by the time it returns, so
    closing the group here is local clean-up.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _main(argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "demo":
        from lightning_bigtrain.demo import main as demo_main

        sys.exit(demo_main(args[1:]))
    if args and args[0] == "consolidate":
        sys.exit(_consolidate_main(args[1:]))
    if args and args[0] == "data":
        from lightning_bigtrain.data.optimize import main as data_main

        sys.exit(data_main(args[1:]))
    if args and args[0] == "plan":
        from lightning_bigtrain.planning.cli import main as plan_main

        sys.exit(plan_main(args[1:]))
    if args and args[0] == "tune":
        from lightning_bigtrain.tune.cli import main as tune_main

        sys.exit(tune_main(args[1:]))
    try:
        BigtrainCLI(args=args)
    except Exception as err:
        missing = _missing_data_error(err)
        if missing is None:
            raise
        sys.exit(f"error: {missing}")


def _consolidate_main(argv: list[str]) -> int:
    import argparse

    from lightning_bigtrain.strategies.zero import consolidate_checkpoint

    parser = argparse.ArgumentParser(
        prog="bigtrain consolidate",
        description="Turn a sharded ZeroStrategy checkpoint folder into one file that plain Lightning loads "
        "(load_from_checkpoint) and resumes (Trainer(strategy='ddp').fit(..., ckpt_path=FILE)), optimizer states "
        "included.",
    )
    parser.add_argument("checkpoint", help="the sharded checkpoint folder (e.g. .../last.ckpt)")
    parser.add_argument("output", help="the single checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        out = consolidate_checkpoint(args.checkpoint, args.output)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {out}")
    return 0


def _missing_data_error(err: BaseException) -> BaseException | None:
    """The MissingDataError behind ``err`` (jsonargparse wraps errors raised while instantiating)."""
    from lightning_bigtrain.data import MissingDataError

    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, MissingDataError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


if __name__ == "__main__":
    main()
