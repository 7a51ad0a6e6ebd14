"""multiproc: a multiprocess stage executor.

Each pipeline stage has its own resizable pool of worker processes; stages are joined by
shared-memory channels with byte budgets; every worker exports lock-free counters. Knows
nothing about tuning or any model: ``torchtune_pipe`` builds on it.
"""

from .errors import (
    ExecutorClosedError,
    ExecutorError,
    RemoteTraceback,
    SpecError,
    StageError,
    WorkerDiedError,
)
from .executor import Executor
from .reducers import Batcher, Shuffler
from .spec import ExecutorSpec, Reducer, StageSpec
from .stats import Snapshot, StageSnapshot, WorkerStats

__all__ = [
    "Batcher",
    "Executor",
    "ExecutorClosedError",
    "ExecutorError",
    "ExecutorSpec",
    "Reducer",
    "RemoteTraceback",
    "Shuffler",
    "Snapshot",
    "SpecError",
    "StageError",
    "StageSnapshot",
    "StageSpec",
    "WorkerDiedError",
    "WorkerStats",
]
