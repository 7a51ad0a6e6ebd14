"""multiproc: a multiprocess stage executor.

Each pipeline stage has its own resizable pool of worker processes; stages are joined by
shared-memory channels with byte budgets; every worker exports lock-free counters. Knows
nothing about tuning or any model: ``torchtune_pipe`` builds on it.
"""

from . import concurrency
from .concurrency import CallPool
from .errors import (
    ExecutorClosedError,
    ExecutorError,
    RemoteTraceback,
    SharedMemoryError,
    SpecError,
    StageError,
    StageTimeoutError,
    TooManyErrorsError,
    WorkerDiedError,
)
from .executor import Executor
from .faults import Busy
from .offload import Offload
from .reducers import Batcher, Shuffler
from .spec import ExecutorSpec, Reducer, Skipped, StageSpec
from .stats import Snapshot, StageSnapshot, WorkerStats
from .worker import in_thread_worker

__all__ = [
    "Batcher",
    "Busy",
    "CallPool",
    "Executor",
    "ExecutorClosedError",
    "ExecutorError",
    "ExecutorSpec",
    "Offload",
    "Reducer",
    "RemoteTraceback",
    "SharedMemoryError",
    "Shuffler",
    "Skipped",
    "Snapshot",
    "SpecError",
    "StageError",
    "StageSnapshot",
    "StageSpec",
    "StageTimeoutError",
    "TooManyErrorsError",
    "WorkerDiedError",
    "WorkerStats",
    "concurrency",
    "in_thread_worker",
]
