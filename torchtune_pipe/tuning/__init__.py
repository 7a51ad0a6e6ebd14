"""Tuners and the loop that runs them: everything meets at the :class:`Tunable` seam.

``make_tuner(name)`` builds any tuner in :data:`TUNERS`; :class:`TuningLoop` runs one beside
training; :func:`run_episode` runs one against a simulator without waiting. Both apply every
decision through :class:`Guarded`, the one place the hard limits are enforced.
"""

from torchtune_pipe.tuning.autotune import AutotuneConfig, AutotuneTuner
from torchtune_pipe.tuning.base import (
    Allocation,
    Limits,
    MiB,
    Observation,
    StageStats,
    Tunable,
    Tuner,
)
from torchtune_pipe.tuning.baselines import (
    HeuristicTuner,
    StaticTuner,
    UnoptimizedTuner,
    even_split,
)
from torchtune_pipe.tuning.loop import TuningLoop, run_episode
from torchtune_pipe.tuning.oracle import OracleTuner, oracle_search
from torchtune_pipe.tuning.plumber import PlumberPlan, PlumberTuner
from torchtune_pipe.tuning.registry import TUNERS, make_tuner
from torchtune_pipe.tuning.safety import Guarded, is_io_bound, oversubscribe_factor

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
