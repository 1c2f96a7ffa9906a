"""``bigtrain tune``: run (or continue) a study from a tune config; print its table, save the plot and the best
configs."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

__all__ = ["main"]


def _stop(signum: int, frame: Any) -> None:
    # Unwinds through the running trial's wait, which stops the trial's process group: the study resumes it.
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    from lightning_bigtrain.tune.tuner import TrialsFailingError, Tuner, TunerConfigError

    parser = argparse.ArgumentParser(
        prog="bigtrain tune",
        description="Search Trainer-level choices (strategy, compression, precision, ...) and the model's own "
        "hyper-parameters: every trial a real `bigtrain fit` run, planned before launch, pruned at the step level. "
        "Run it again (or in several shells on one storage) to continue or share a study.",
    )
    parser.add_argument("--config", required=True, help="a tune config (see configs/tune.yaml)")
    parser.add_argument("--trials", type=int, help="trials in the study, over all workers (overrides `trials:`)")
    parser.add_argument("--output", help="the study's folder (overrides `output:`)")
    parser.add_argument("--storage", help="an Optuna URL or a journal file path (overrides `study.storage:`)")
    parser.add_argument("--study-name", help="overrides `study.name:`")
    parser.add_argument(
        "--backend",
        choices=("local", "ray"),
        help="where the trials run (overrides `backend:`): here, one at a time, or on Ray Tune",
    )
    parser.add_argument("--report-only", action="store_true", help="print the table of the study as it is; run nothing")
    args = parser.parse_args(argv)
    try:
        tuner = Tuner.from_yaml(args.config, trials=args.trials, output=args.output, storage=args.storage,
                                study_name=args.study_name, backend=args.backend)  # fmt: skip
    except (TunerConfigError, ValueError, TypeError) as err:
        parser.error(str(err))
    if not args.report_only:
        signal.signal(signal.SIGTERM, _stop)
        try:
            tuner.run()
        except TrialsFailingError as err:
            print(tuner.table())
            print(f"bigtrain tune: error: {err}", file=sys.stderr)
            return 1
    table = tuner.table()
    print(table)
    (tuner.output / "table.md").write_text(table + "\n")
    print(f"trials by outcome: {tuner.summary()}")
    plot = tuner.pareto_plot()
    if plot is not None:
        print(f"wrote {plot}")
    for path in tuner.write_best_configs():
        print(f"best: bigtrain fit --config {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
