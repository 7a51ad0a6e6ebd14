"""Delivery to the training loop: a prefetch thread and the pinning/device transfer it applies.

:class:`Prefetcher` runs the loader's item stream on a daemon thread a bounded number of items
ahead of the consumer; :func:`transfer` (on that thread, through :class:`Transfer`) pins and
moves the tensors of a batch (nested containers, TensorDicts, objects with their own
``pin_memory``/``to`` such as TorchRec's Batch) to the device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

# What Prefetcher.get returns at the end of the stream.
END = object()


def transfer(
    obj: Any, pin_memory: bool = False, device: Any = None, non_blocking: bool = True
) -> Any:
    """Pin and/or move every tensor in ``obj`` (nested containers, TensorDicts) to ``device``."""
    import torch

    if isinstance(obj, torch.Tensor):
        if pin_memory and not obj.is_pinned():
            obj = obj.pin_memory()
        if device is not None:
            obj = obj.to(device, non_blocking=non_blocking)
        return obj
    if type(obj).__name__ in ("TensorDict", "LazyStackedTensorDict") and hasattr(obj, "to"):
        if pin_memory:
            obj = obj.pin_memory()
        return obj.to(device, non_blocking=non_blocking) if device is not None else obj
    if callable(getattr(obj, "pin_memory", None)) and callable(getattr(obj, "to", None)):
        # Batch-like objects that move themselves (TorchRec's Batch, Pipelineable).
        if pin_memory:
            obj = obj.pin_memory()
        return obj.to(device=device, non_blocking=non_blocking) if device is not None else obj
    if isinstance(obj, Mapping):
        items = {k: transfer(v, pin_memory, device, non_blocking) for k, v in obj.items()}
        try:
            return cast(Any, type(obj))(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(transfer(v, pin_memory, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(transfer(v, pin_memory, device, non_blocking) for v in obj)
    return obj


def accelerator_available() -> bool:
    """Whether pinning memory makes sense here (an accelerator is present)."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return bool(acc.is_available())
    return torch.cuda.is_available()


class Prefetcher:
    """Runs ``stream`` on a daemon thread, ``depth`` items ahead of the consumer.

    Args:
        stream: tagged items ``(unit, k, x)``.
        depth: queue bound.
        convert: applied to ``x`` on the thread (pinning, device transfer), or None.
        timeout_s: :meth:`get` raises ``TimeoutError`` after waiting this long (0: forever).
    """

    def __init__(
        self,
        stream: Iterator[tuple],
        depth: int,
        convert: Callable[[Any], Any] | None = None,
        timeout_s: float = 0.0,
    ):
        self._stream = stream
        self._convert = convert
        self._timeout = timeout_s if timeout_s > 0 else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ttp-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for t in self._stream:
                if self._stop.is_set():
                    return
                if self._convert is not None and t[1] is not None and not (t[0] >= 0 and t[1] < 0):
                    t = (t[0], t[1], self._convert(t[2]))
                self._queue.put(("item", t))
                if self._stop.is_set():
                    return
            self._queue.put(("end", None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            if not self._stop.is_set():
                self._queue.put(("error", e))

    def get(self) -> Any:
        """The next tagged item, or ``END`` at the end of the stream.

        Raises:
            TimeoutError: nothing arrived within ``timeout_s``.
            BaseException: whatever the stream raised.
        """
        try:
            kind, value = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            raise TimeoutError(f"no item within {self._timeout} s") from None
        if kind == "item":
            return value
        if kind == "end":
            return END
        raise value

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread: empty the queue so a blocked ``put`` returns, then join."""
        self._stop.set()
        # After this drain the thread's pending put (at most one: it checks the flag after
        # every put) finds room, so the join below only waits for the current item.
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout_s)

    def held_bytes(self) -> int:
        """Host bytes of the converted items waiting in the queue: pinned copies. Items not
        converted are views of the pipeline's arenas (counted there); device copies hold no
        host memory."""
        if self._convert is None:
            return 0
        with self._queue.mutex:
            waiting = [v for kind, v in self._queue.queue if kind == "item"]
        return sum(_pinned_bytes(t[2]) for t in waiting)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()


def _pinned_bytes(obj: Any) -> int:
    """Bytes of the pinned host tensors in ``obj`` (nested containers, TensorDicts)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type == "cpu" and obj.is_pinned() else 0
    if hasattr(obj, "values") and callable(obj.values):
        try:
            return sum(_pinned_bytes(v) for v in obj.values())
        except TypeError:
            return 0
    if isinstance(obj, (list, tuple)):
        return sum(_pinned_bytes(v) for v in obj)
    return 0


class Transfer:
    """Picklable device-transfer function for the prefetch thread."""

    def __init__(self, pin: bool, device: Any, non_blocking: bool):
        self.pin, self.device, self.non_blocking = pin, device, non_blocking

    def __call__(self, x: Any) -> Any:
        return transfer(x, self.pin, self.device, self.non_blocking)
