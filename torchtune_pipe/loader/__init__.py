"""The Loader (one epoch per ``iter()``) and its parts: the epoch's iterator and stream,
the fast start, the running pipeline a tuner steers, progress and state, ranks, prefetch."""

from torchtune_pipe.loader.core import (
    Loader,
)

__all__ = [
    "Loader",
]
