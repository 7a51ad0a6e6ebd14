"""Stage functions for executor tests (module level so worker processes can import them)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch


def read_range(unit):
    lo, hi = unit
    yield from range(lo, hi)


def identity(x):
    return x


def add_one(x):
    return x + 1


def fail_on_13(x):
    if x == 13:
        raise KeyError(f"bad id {x}")
    return x


def big_tensor(x):
    return {"id": x, "payload": torch.full((64 * 1024,), float(x))}


def die_on_first(x):
    os.kill(os.getpid(), signal.SIGKILL)


def make_payload(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(8192, 13, generator=g),
        "i64": torch.randint(0, 1 << 40, (50000,), generator=g),
        "bf16": torch.randn(3000, generator=g).bfloat16(),
        "bool": torch.rand(5000, generator=g) > 0.5,
        "strided": torch.arange(20000.0).reshape(100, 200)[:, ::3],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "np": np.arange(10000, dtype=np.int32).reshape(100, 100),
        "np_small": np.arange(4),
        "nested": [("a", 1), {"b": torch.ones(3)}],
        "text": "héllo",
    }


def two_mb(x):
    return {"id": x, "payload": torch.full((512 * 1024,), float(x))}


def slow_identity(x):
    """A stage slower than its source: 1 ms per item."""
    time.sleep(0.001)
    return x


def burn_2ms(x):
    """Spin the CPU for 2 ms (no sleeping), then return ``x``."""
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass
    return x


def _die_once(marker: str) -> None:
    """Kill this process (SIGKILL) unless ``marker`` exists; create it first."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


class DieOnceOnFirst:
    """Identity, except that the first call anywhere kills its worker (SIGKILL), once: a
    marker file records that it happened, so the restarted worker lets items through."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, x):
        _die_once(self.marker)
        return x


def read_fail_at_100(unit):
    """A source whose unit breaks at its 101st item (a generator cannot go on after that)."""
    lo, hi = unit
    for i in range(lo, hi):
        if i - lo == 100:
            raise ValueError(f"corrupt record {i}")
        yield i


def fail_every_5th(x):
    if x % 5 == 0:
        raise ValueError(f"bad {x}")
    return x


def lock_on_13(x):
    import threading

    return {"id": x, "state": threading.Lock()} if x == 13 else {"id": x}


def read_big_unit(unit):
    raise ValueError("cannot open")
    yield


def sleep_on_7(x):
    if x == 7:
        time.sleep(30)
    return x


def read_stuck_at_3(unit):
    lo, hi = unit
    for i in range(lo, hi):
        if i == 3:
            time.sleep(30)
        yield i


def wait_10ms_thread(x):
    """A call that waits (a remote read): returns the id and the thread that ran it."""
    import threading

    time.sleep(0.01)
    return (x, threading.get_ident())


def wait_then_fail_on_5(x):
    time.sleep(0.005)
    if x % 10 == 5:
        raise KeyError(f"missing record {x}")
    return x


def read_range_concurrently(unit):
    """A source that fetches its unit's records through the worker's call pool."""
    from multiproc import concurrency

    lo, hi = unit
    for o in concurrency.current().map(wait_10ms_thread, range(lo, hi)):
        if o.error is not None:
            raise o.error
        yield o.value


def ten_mb(x):
    """An item of 10 MiB (float32)."""
    return {"id": x, "payload": torch.full((10 * 1024 * 1024 // 4,), float(x))}


def two_mb_out_of_order(x):
    """A 2 MiB item; every third one takes 20 ms longer, so two workers finish out of order."""
    if x % 3 == 0:
        time.sleep(0.02)
    return two_mb(x)


def ids_of(batch):
    """Collate of a batch of ``{"id", "payload"}`` items: their ids only."""
    return [x["id"] for x in batch]


class ReadBigDieOnce:
    """A source of 1 MiB items that kills its worker (SIGKILL) at item 50, once (a marker
    file records it), after it has committed frames of that unit."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, unit):
        lo, hi = unit
        for i in range(lo, hi):
            if i == 50 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            yield {"id": i, "payload": torch.full((256 * 1024,), float(i))}


def id_of(x):
    return x["id"]


def times_two(x):
    return x * 2


def minus_three(x):
    return x - 3


class Blob:
    """An object that is neither a container nor an array: sized by pickling it."""

    def __init__(self, n: int):
        self.data = bytes(n)


def private_mappings(mib: int) -> int:
    """How many of this process's memory mappings hold at least ``mib`` MiB of its own
    (written, not shared) pages."""
    n = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                n += int(line.split()[1]) >= (mib << 10)
    return n


class BigBuffers:
    """A map holding ``mib`` MiB in ``data`` (bytes, or a numpy array): returns how many of
    the worker's mappings hold that much of its own (see :func:`private_mappings`)."""

    def __init__(self, mib: int, array: bool = False):
        self.mib = mib
        self.data = np.ones(mib << 20, dtype=np.uint8) if array else b"\1" * (mib << 20)

    def __call__(self, x):
        return private_mappings(self.mib)


class Views:
    """A map over tensors and arrays that view each other as the consumer built them: returns
    what a worker sees of them, and writes to its copy (which no other process may see)."""

    def __init__(self):
        base = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
        self.base = base
        self.rows = base.view(-1, 8)  # a view of base
        self.cols = base.view(-1, 8)[:, 2]  # strided, offset
        self.tail = base[1000:]
        self.ints = torch.arange(1 << 18, dtype=torch.int64).view(512, 512).t()  # 2 MiB
        self.f = np.asfortranarray(np.arange(1 << 18, dtype=np.float64).reshape(512, 512))
        self.strided = np.arange(1 << 19, dtype=np.int32)[::2]  # not contiguous, 1 MiB
        self.small = torch.arange(10)  # stays in the pickle

    def __call__(self, x):
        self.rows[0, 1] = -1.0  # must show through base, cols and tail only in this worker
        return (
            float(self.base[1]), float(self.cols[3]), float(self.tail[0]),
            int(self.ints[3, 5]), bool(self.ints.is_contiguous()), float(self.f[3, 5]),
            bool(self.f.flags.f_contiguous), int(self.strided[7]), int(self.small[9]),
            self.base.untyped_storage().data_ptr() == self.tail.untyped_storage().data_ptr(),
        )  # fmt: skip


def tag_local(x):
    return (x, "local")


def remote_fail_on_13(x):
    if x == 13:
        raise KeyError(f"bad id {x} on the remote side")
    return x


class FakeRemote:
    """A remote runtime without a cluster, for offload tests: each worker's copy starts a
    server thread (its "actor") that maps a frame's items; the worker sends it the frame,
    waits for the answer and reports the call (``add_remote_call``). Outputs are
    ``(x, "remote")``."""

    THREAD = "fake-remote"

    def __init__(self, fn):
        self.fn = fn
        self._jobs = None
        self._server = None

    def __getstate__(self):
        return {"fn": self.fn, "_jobs": None, "_server": None}

    def start(self, stage, index):
        import queue
        import threading

        self._jobs = queue.SimpleQueue()
        self._server = threading.Thread(target=self._serve, name=self.THREAD, daemon=True)
        self._server.start()

    def _serve(self):
        while (job := self._jobs.get()) is not None:
            items, box = job
            t0 = time.perf_counter_ns()
            try:
                box["out"] = [(x, "remote") for x in map(self.fn, items)]
            except Exception as e:
                box["error"] = e
            box["fn_ns"] = time.perf_counter_ns() - t0
            box["done"].set()

    def __call__(self, items):
        import pickle
        import threading

        from multiproc import concurrency

        box = {"done": threading.Event()}
        t0 = time.perf_counter_ns()
        self._jobs.put((items, box))
        box["done"].wait()
        wait = time.perf_counter_ns() - t0 - box["fn_ns"]
        if "error" in box:
            raise box["error"]
        nbytes = len(pickle.dumps(items)) + len(pickle.dumps(box["out"]))
        concurrency.current().add_remote_call(nbytes, wait)
        return box["out"]

    def on_worker_exit(self):
        if self._server is not None:
            self._jobs.put(None)
            self._server.join(5.0)
            self._server = None


class ReadSideBySide:
    """A source whose units of ``(lo, hi)`` fetch their records through the worker's call
    pool (10 ms of waiting each) and that lets a worker read its units side by side
    (``calls_per_unit``, :mod:`multiproc.readahead`). An item is ``(id, read start, read
    end)`` of its unit; after its records, a unit yields an end mark ``(-1, lo, hi)`` that is
    not an item. ``fail_at``: the id whose read raises; ``die_at``: the id whose read kills
    the worker (SIGKILL) the first time, once per ``marker`` file; ``hang_at``: the id whose
    read never ends."""

    def __init__(self, fail_at=None, die_at=None, marker=None, hang_at=None):
        self.fail_at, self.die_at, self.marker, self.hang_at = fail_at, die_at, marker, hang_at

    def calls_per_unit(self, unit):
        return unit[1] - unit[0]

    def _fetch(self, i):
        time.sleep(0.01)
        if i == self.fail_at:
            raise KeyError(f"missing record {i}")
        if i == self.hang_at:
            time.sleep(60)
        if i == self.die_at:
            _die_once(self.marker)
        return i

    def __call__(self, unit):
        from multiproc import concurrency

        lo, hi = unit
        t0 = time.monotonic()
        outs = concurrency.current().map(self._fetch, range(lo, hi))
        t1 = time.monotonic()
        for o in outs:
            if o.error is not None:
                raise o.error
            yield (o.value, t0, t1)
        concurrency.not_an_item()
        yield (-1, lo, hi)


def collate_as_a_worker(x):
    """torch's ``default_collate`` of two rows made from ``x`` while ``get_worker_info()`` is
    set (as in a worker of the drop-in DataLoader), and whether the batch is in shared memory."""
    from torch.utils.data import default_collate
    from torch.utils.data._utils import worker

    saved = worker._worker_info
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        batch = default_collate([torch.full((3,), float(x)), torch.full((3,), float(x + 1))])
    finally:
        worker._worker_info = saved
    return batch, batch.is_shared()


class SleepOnceOn7:
    """Identity; item 7 sleeps 30 s the first time anywhere (a marker file records it), so a
    test can kill the worker inside its call and the restarted worker goes on at once."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, x):
        if x == 7:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return x
            os.close(fd)
            time.sleep(30)
        return x


def read_two_mb_items(unit):
    """A source of 2 MiB items (float32, each filled with its index)."""
    for i in range(*unit):
        yield torch.full((1 << 19,), float(i))


def read_slowly(unit):
    """A source that takes 10 ms per item (a unit of 300 lasts 3 s, as a shard does)."""
    for i in range(*unit):
        time.sleep(0.01)
        yield i


def read_range_dying_at_13(unit):
    """``read_range`` whose process is killed (SIGKILL) when it reaches item 13."""
    for i in range(*unit):
        if i == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        yield i


class SlowItems:
    """A source whose units ``(lo, hi)`` yield their ids one per 50 ms, read side by side by a
    worker whose calls in flight allow it (``calls_per_unit``, :mod:`multiproc.readahead`)."""

    def calls_per_unit(self, unit):
        return 1

    def __call__(self, unit):
        lo, hi = unit
        for i in range(lo, hi):
            time.sleep(0.05)
            yield i
