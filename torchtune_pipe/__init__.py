"""torchtune_pipe: self-tuning data-loading pipelines for PyTorch.

Build a :class:`Pipeline` from a source, iterate it with a :class:`Loader` (optionally steered
by a tuner), or swap ``torch.utils.data.DataLoader`` for :class:`DataLoader`.
"""

from torchtune_pipe.dataloader import DataLoader
from torchtune_pipe.errors import (
    BadLinesError,
    LoaderTimeoutError,
    PipelineError,
    RemoteStageError,
    SourceError,
    StateError,
    TorchtunePipeError,
)
from torchtune_pipe.loader.core import Loader
from torchtune_pipe.loader.prefetch import transfer
from torchtune_pipe.options import StageOptions, Strategy
from torchtune_pipe.pipeline import Pipeline, Prefetch, Stage
from torchtune_pipe.sources.base import (
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
