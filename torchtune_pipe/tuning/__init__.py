"""Tuners and the loop that runs them: everything meets at the :class:`Tunable` seam.

``make_tuner(name)`` builds any tuner in :data:`TUNERS`; :class:`TuningLoop` runs one beside
training; :func:`run_episode` runs one against a simulator without waiting. Both apply every
decision through :class:`Guarded`, the one place the hard limits are enforced.
"""

from .autotune import AutotuneConfig, AutotuneTuner
from .base import (
    Allocation,
    Limits,
    MiB,
    Observation,
    StageStats,
    Tunable,
    Tuner,
)
from .baselines import HeuristicTuner, StaticTuner, UnoptimizedTuner, even_split
from .loop import TuningLoop, run_episode
from .oracle import OracleTuner, oracle_search
from .plumber import PlumberPlan, PlumberTuner
from .registry import TUNERS, make_tuner
from .safety import Guarded, is_io_bound, oversubscribe_factor

__all__ = [
    "Allocation",
    "AutotuneConfig",
    "AutotuneTuner",
    "Guarded",
    "HeuristicTuner",
    "Limits",
    "MiB",
    "Observation",
    "OracleTuner",
    "PlumberPlan",
    "PlumberTuner",
    "StageStats",
    "StaticTuner",
    "TUNERS",
    "Tunable",
    "Tuner",
    "TuningLoop",
    "UnoptimizedTuner",
    "even_split",
    "is_io_bound",
    "make_tuner",
    "oracle_search",
    "oversubscribe_factor",
    "run_episode",
]
