"""Fast start: an epoch's first units run in the calling thread while the workers start.

Starting worker processes costs about a second or more (the fork server imports torch, every
worker unpickles the dataset), and torch's DataLoader hands out its first batch long before
that. So the first units of an epoch are read inline, one at a time, in the consumer's thread,
while the executor starts in a background thread; once every worker has said hello, the units
not yet taken go to the executor. Units are taken in order and an inline unit is read whole
before it is delivered, so the order, the batch boundaries and the exactly-once bookkeeping are
those of a run on workers alone.

Per-unit seeds make an inline unit draw the numbers a worker would draw; the global generators
of the calling thread are saved around each inline read and restored, so the training loop's
own random draws are not disturbed.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .pipeline import Pipeline, Work, run_inline

log = logging.getLogger(__name__)

# How long a consumer that stops during the inline phase waits for the executor being built
# (so that it can be closed rather than leaked).
_JOIN_S = 120.0


@contextlib.contextmanager
def _isolated_rng() -> Iterator[None]:
    import numpy as np
    import torch

    py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(th)


class FastStart:
    """The stream of one epoch: inline units until the executor is ready, then the executor.

    Args:
        pipeline: the pipeline (no shuffle or batch stages: those group items across units).
        works: the epoch's work, in order.
        epoch: the epoch.
        start: builds the executor (called once, on a background thread).
        on_started: called in the consumer's thread when the executor takes over (the loader
            starts its tuner there).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        works: list[Work],
        epoch: int,
        start: Callable[[], Any],
        on_started: Callable[[], None],
    ):
        self.pipeline = pipeline
        self.works = works
        self.epoch = epoch
        self.on_started = on_started
        self.inline_units = 0
        self.inline_s = 0.0  # wall time spent reading inline units
        self._executor: Any = None
        self._error: BaseException | None = None
        self._built = threading.Event()
        self._thread = threading.Thread(
            target=self._build, args=(start,), name="torchtune_pipe-start", daemon=True
        )
        self._thread.start()

    def _build(self, start: Callable[[], Any]) -> None:
        try:
            self._executor = start()
        except BaseException as e:  # raised in the consumer's thread by stream()
            self._error = e
        finally:
            self._built.set()

    def _ready(self) -> bool:
        """Built, and every worker has started (said hello), or building failed."""
        if not self._built.is_set():
            return False
        ex = self._executor
        if ex is None:
            return True
        want = sum(ex.workers(i) for i in range(len(ex.spec.stages)))
        return len(ex.start_latencies_ms()) >= want

    def stream(self) -> Iterator[tuple]:
        """The tagged items of the epoch (as ``Executor.run`` yields them)."""
        i = 0
        while i < len(self.works) and not self._ready():
            t0 = time.perf_counter()
            with _isolated_rng():
                items = list(run_inline(self.pipeline, [self.works[i]], self.epoch))
            self.inline_s += time.perf_counter() - t0
            i += 1
            self.inline_units = i
            yield from items
        self.join()
        if self._error is not None:
            raise self._error
        log.debug("fast start: %d unit(s) read inline in %.3f s", i, self.inline_s)
        self.on_started()
        if i < len(self.works):
            yield from self._executor.run(self.works[i:], self.epoch)

    def join(self) -> None:
        """Wait until the executor is built (or failed), so that nothing is left half made."""
        if not self._built.wait(_JOIN_S):
            log.warning("fast start: the executor did not start within %.0f s", _JOIN_S)
