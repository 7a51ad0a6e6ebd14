"""torchtune_pipe: self-tuning data-loading pipelines for PyTorch.

Build a :class:`Pipeline` from a source, iterate it with a :class:`Loader` (optionally steered
by a tuner), or swap ``torch.utils.data.DataLoader`` for :class:`DataLoader`.
"""

from .dataloader import DataLoader
from .errors import (
    BadLinesError,
    LoaderTimeoutError,
    PipelineError,
    RemoteStageError,
    SourceError,
    StateError,
    TorchtunePipeError,
)
from .loader import Loader
from .pipeline import Pipeline, Prefetch, Stage
from .prefetch import transfer
from .running import RunningPipeline
from .sources import (
    FileRange,
    IndexUnit,
    IterableDatasetSource,
    LineFileSource,
    MapDatasetSource,
    NodeSource,
    ResumableSource,
    ShardedSource,
    ShardUnit,
    SkippingSource,
    Source,
    as_source,
)
from .telemetry import Machine, Meter, observe

__all__ = [
    "BadLinesError",
    "DataLoader",
    "FileRange",
    "IndexUnit",
    "IterableDatasetSource",
    "LineFileSource",
    "Loader",
    "LoaderTimeoutError",
    "Machine",
    "MapDatasetSource",
    "Meter",
    "NodeSource",
    "Pipeline",
    "PipelineError",
    "Prefetch",
    "RemoteStageError",
    "ResumableSource",
    "RunningPipeline",
    "ShardUnit",
    "ShardedSource",
    "SkippingSource",
    "Source",
    "SourceError",
    "Stage",
    "StateError",
    "TorchtunePipeError",
    "as_source",
    "observe",
    "transfer",
]
