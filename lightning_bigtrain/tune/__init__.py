"""``bigtrain tune``: hyper-parameter search over the training techniques themselves, on Optuna.

:class:`Tuner` runs a study over a ``bigtrain fit`` config (each trial a real run on all its ranks), gates every
configuration through the planner, prunes at the step level under any strategy (:class:`TuneTrial`), and resumes
a killed study. The method card is ``docs/tune.md``.
"""

from lightning_bigtrain.tune.space import Parameter, SearchSpace
from lightning_bigtrain.tune.trial import MEASURES, TuneTrial, make_pruner, open_storage
from lightning_bigtrain.tune.tuner import TrialsFailingError, Tuner, TunerConfigError

__all__ = [
    "MEASURES",
    "Parameter",
    "SearchSpace",
    "TrialsFailingError",
    "TuneTrial",
    "Tuner",
    "TunerConfigError",
    "make_pruner",
    "open_storage",
]
