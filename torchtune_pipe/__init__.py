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
from .options import StageOptions, Strategy
from .pipeline import Pipeline, Prefetch, Stage
from .prefetch import transfer
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

__all__ = [
    "BadLinesError",
    "DataLoader",
    "FileRange",
    "IndexUnit",
    "IterableDatasetSource",
    "LineFileSource",
    "Loader",
    "LoaderTimeoutError",
    "MapDatasetSource",
    "NodeSource",
    "Pipeline",
    "PipelineError",
    "Prefetch",
    "RemoteStageError",
    "ResumableSource",
    "ShardUnit",
    "ShardedSource",
    "SkippingSource",
    "Source",
    "SourceError",
    "Stage",
    "StageOptions",
    "StateError",
    "Strategy",
    "TorchtunePipeError",
    "as_source",
    "transfer",
]
