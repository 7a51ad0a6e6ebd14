"""One epoch as the consumer sees it: the iterator ``iter(loader)`` returns, and the tagged
stream it reads (through the prefetch thread, round-robin across units, to its last marker)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

from torchtune_pipe.errors import LoaderTimeoutError
from torchtune_pipe.loader.prefetch import END, Prefetcher, Transfer, accelerator_available
from torchtune_pipe.loader.progress import Progress
from torchtune_pipe.stages import Prefetch

log = logging.getLogger(__name__)

# How long closing an epoch waits for its prefetch thread to finish the item it is on.
PREFETCH_STOP_S = 10.0
# After a timeout the thread is stuck in a stage: a token wait before leaving it behind.
TIMED_OUT_STOP_S = 0.1
# Items the loader's own prefetch thread holds ahead when only a timeout asks for the thread.
TIMEOUT_PREFETCH_DEPTH = 2


class EpochIterator:
    """What ``iter(loader)`` returns: one epoch's items, for one consumer thread.

    As torch's DataLoader, a new ``iter()`` on the loader starts a new epoch; this iterator
    then raises ``RuntimeError`` if used again (never a silent stop). Two threads calling
    ``next()`` on it at once get ``RuntimeError`` as well.
    """

    def __init__(self, gen: Generator[Any, None, None], epoch: int):
        self._gen = gen
        self._epoch = epoch
        self._busy = threading.Lock()
        self._ended: str | None = None

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._ended is not None:
            raise RuntimeError(f"Loader: this iterator of epoch {self._epoch} {self._ended}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "Loader: two threads iterate the same loader at once; one loader feeds one "
                "consumer thread (create a loader per thread, or hand items over a queue)"
            )
        try:
            return next(self._gen)
        finally:
            self._busy.release()

    def close(self) -> None:
        """End the epoch early (as ``break`` does)."""
        self._gen.close()

    def _end(self, why: str) -> None:
        """Ended from outside (a new ``iter()``, ``load_state_dict``, ``close``)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"Loader: {why.split(';')[0]} while another thread is inside next() of the "
                "current epoch; one loader feeds one consumer thread"
            )
        try:
            self._ended = why
            self._gen.close()
        finally:
            self._busy.release()


def interleave(
    stream: Iterator[tuple], starts: dict[int, int], start_after: int
) -> Iterator[tuple]:
    """Round-robin over units, one item each, skipping finished units: the order torch's
    DataLoader gives an IterableDataset read by one worker per shard.

    ``starts`` maps each unit to read (in order) to its first undelivered position;
    ``start_after`` is the unit whose item was delivered last (-1: none).
    """
    active = list(starts)
    nxt = dict(starts)
    pending: dict = {}
    totals: dict = {}
    cur = next((i for i, u in enumerate(active) if u > start_after), 0)
    for t in stream:
        u, k, _ = t
        if k < 0:
            totals[u] = -1 - k
        else:
            pending[(u, k)] = t
        while active:
            cu = active[cur]
            item = pending.pop((cu, nxt[cu]), None)
            if item is not None:
                yield item
                nxt[cu] += 1
                cur = (cur + 1) % len(active)
                continue
            if totals.get(cu) is not None and totals[cu] <= nxt[cu]:
                yield (cu, -1 - totals[cu], None)
                active.pop(cur)
                cur = cur % len(active) if active else 0
                continue
            break


def skip_prefix(skip: set[int]) -> int:
    n = 0
    while n in skip:
        n += 1
    return n


def make_prefetcher(
    spec: Prefetch | None, stream: Iterator[tuple], timeout_s: float
) -> Prefetcher | None:
    """The prefetch thread of an epoch: for a pipeline ending in ``prefetch()``, or a loader
    with a timeout (the thread is what lets the consumer stop waiting); else None."""
    if spec is None and not timeout_s:
        return None
    convert = None
    depth = TIMEOUT_PREFETCH_DEPTH
    if spec is not None:
        depth = spec.depth
        pin = spec.pin_memory and accelerator_available()
        if pin or spec.device is not None:
            convert = Transfer(pin, spec.device, spec.non_blocking)
    return Prefetcher(stream, depth, convert, timeout_s)


class EpochFeed:
    """The tagged stream of an epoch, read through its prefetcher when there is one.

    Args:
        stream: the tagged items (and end-of-unit markers).
        pre: the prefetcher running ``stream`` (None: read ``stream`` here).
        timeout_s: the loader's timeout (for the error message).
        inline: the pipeline runs inline (for the error message).
        stuck: what the workers are busy with, for a timeout's message.
    """

    def __init__(
        self,
        stream: Iterator[tuple],
        pre: Prefetcher | None,
        timeout_s: float,
        inline: bool,
        stuck: Callable[[], list],
    ):
        self.stream = stream
        self.pre = pre
        self.timeout_s = timeout_s
        self.inline = inline
        self.stuck = stuck

    def next(self) -> Any:
        """The next tagged item or marker; ``prefetch.END`` at the end.

        Raises:
            LoaderTimeoutError: nothing arrived within the timeout; ``stuck`` says where
                the workers are.
        """
        if self.pre is None:
            return next(self.stream, END)
        try:
            return self.pre.get()
        except TimeoutError:
            busy = self.stuck()
            if busy:
                where = "; ".join(str(b) for b in busy[:3])
            elif self.inline:
                where = "the pipeline runs inline, in the loader's prefetch thread"
            else:
                where = "no worker is inside its stage function (see progress=True)"
            e = LoaderTimeoutError(
                f"Loader: no item arrived within timeout_s={self.timeout_s} s: {where}"
            )
            e.stuck = tuple(busy)
            raise e from None

    def drain_tail(self, progress: Progress, drop_items: bool = False) -> tuple[bool, int]:
        """Consume end-of-unit markers after the last item: ``(complete, dropped)``, where
        ``complete`` is False if another item came (``drop_items``: read to the end, counting
        the items in ``dropped``)."""
        dropped = 0
        while True:
            t = self.next()
            if t is END:
                return True, dropped
            u, k, _ = t
            if u >= 0 and k < 0:
                progress.end(u, -1 - k)
            elif drop_items:
                dropped += 1
            else:
                return False, dropped

    def close(self, timed_out: bool = False) -> None:
        """Stop the prefetch thread and close the stream. After a timeout the thread is stuck
        in a stage: it is not waited for (nor is the stream closed under it)."""
        pre = self.pre
        if pre is not None:
            pre.stop(timeout_s=TIMED_OUT_STOP_S if timed_out else PREFETCH_STOP_S)
            if pre.alive:
                log.warning("Loader: the prefetch thread is still busy in a stage; left behind")
        close = getattr(self.stream, "close", None)
        if close is not None and (pre is None or not pre.alive):
            close()
