"""Pipeline simulator: a fast fluid model for offline pre-training and large-machine studies.

``SimPipeline`` implements the same :class:`~torchtune_pipe.tuning.base.Tunable` seam as a
running pipeline, so tuners are trained and benchmarked here and deployed unchanged.
"""

from torchtune_pipe.sim.model import Drift, SimPipeline, StageModel, SteadyState, Workload
from torchtune_pipe.sim.workloads import (
    PRESETS,
    criteo_like,
    generate,
    netflix_like,
    with_batch_size,
)

__all__ = [
    "Drift",
    "PRESETS",
    "SimPipeline",
    "StageModel",
    "SteadyState",
    "Workload",
    "criteo_like",
    "generate",
    "netflix_like",
    "with_batch_size",
]
