"""The live pipeline's memory: what its processes and buffers hold, and what the cgroup allows.

:class:`MemoryProbe` reads, at most once per ``min_interval_s`` however many meters ask:

* every process of the pipeline: the workers named in the executor's snapshot and their
  parent, the fork server, each by proportional set size less its shared-memory mappings
  (``Pss - Pss_Shmem`` from ``/proc/<pid>/smaps_rollup``): pages the fork server and its
  workers share count once, split between them, and the arenas are not counted here; the
  file of the large arrays their stage pickles hold (:mod:`multiproc.buffers`), which they
  map, counts here once;
* the arenas: the ``/dev/shm`` segments the workers map, by the pages the kernel backs
  (``st_blocks``, so a sparse arena counts what was written, and pages a shrunk budget still
  holds count too);
* what the consumer's process holds for the pipeline (the loader passes the prefetch
  queue's pinned copies).

:func:`cgroup_memory` reads the process's memory cgroup (v2 ``memory.max``/``memory.high``/
``memory.current``/``memory.events``, or v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``/
``memory.oom_control``), walking up to the tightest limit.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from multiproc import Snapshot
from multiproc.buffers import FILE_SUFFIX

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is unlimited.
_UNLIMITED = 1 << 60
_SHM_PREFIX = "/dev/shm/ttp_"


# ---------------------------------------------------------------------------- cgroup
@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup this process runs in.

    Attributes:
        limit_bytes: the tightest limit along the cgroup and its ancestors (v2: the smaller
            of ``memory.max`` and ``memory.high``, where the kernel starts reclaiming and
            throttling); None when there is none.
        used_bytes: what the cgroup holds that the kernel cannot simply drop: its usage less
            its inactive file cache (the working set, as container runtimes count it).
        oom_kills: processes of the cgroup the kernel's OOM killer has killed so far (None
            when the kernel does not say).
    """

    limit_bytes: int | None
    used_bytes: int
    oom_kills: int | None = None

    @property
    def available_bytes(self) -> int | None:
        """What the cgroup can still take before its limit (None when unlimited)."""
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.used_bytes)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _read_keyed(path: Path, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed cgroup file (``memory.stat``, ``memory.events``)."""
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def _own_paths(self_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process, from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _chain(base: Path, path: str | None) -> list[Path]:
    """The cgroup directory of ``path`` under ``base`` and its ancestors up to ``base``.

    A cgroup namespace (containers) shows ``/`` while the mount is the container's own
    cgroup, and a path that does not exist under the mount means the same: ``base`` alone.
    """
    rel = [p for p in (path or "/").split("/") if p]
    leaf = base.joinpath(*rel)
    if not rel or not leaf.is_dir():
        return [base]
    return [base.joinpath(*rel[:k]) for k in range(len(rel), -1, -1)]


def cgroup_memory(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> CgroupMemory | None:
    """The memory cgroup of this process (v2, else v1), or None where there is none.

    Args:
        root: where the cgroup file system is mounted.
        self_cgroup: this process's cgroup membership (``/proc/self/cgroup``).
    """
    v2, v1 = _own_paths(self_cgroup)
    chain = _chain(root, v2)
    if any((d / "memory.current").exists() or (d / "memory.max").exists() for d in chain):
        limits = [
            x
            for d in chain
            for x in (_read_int(d / "memory.max"), _read_int(d / "memory.high"))
            if x is not None
        ]
        leaf = next(d for d in chain if (d / "memory.current").exists() or d == chain[-1])
        usage = _read_int(leaf / "memory.current") or 0
        inactive = _read_keyed(leaf / "memory.stat", "inactive_file") or 0
        kills = _read_keyed(leaf / "memory.events", "oom_kill")
        return CgroupMemory(min(limits) if limits else None, max(0, usage - inactive), kills)
    chain = _chain(root / "memory", v1)
    if any((d / "memory.limit_in_bytes").exists() for d in chain):
        limits = [x for d in chain if (x := _read_int(d / "memory.limit_in_bytes")) is not None]
        leaf = chain[0]
        usage = _read_int(leaf / "memory.usage_in_bytes") or 0
        inactive = _read_keyed(leaf / "memory.stat", "total_inactive_file") or 0
        kills = _read_keyed(leaf / "memory.oom_control", "oom_kill")
        return CgroupMemory(min(limits) if limits else None, max(0, usage - inactive), kills)
    return None


def memory_available_bytes(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """Memory that can still be allocated: psutil's ``available``, capped by what the memory
    cgroup's limit leaves (:func:`cgroup_memory`)."""
    avail = psutil.virtual_memory().available
    cg = cgroup_memory(root, self_cgroup)
    if cg is not None and cg.available_bytes is not None:
        avail = min(avail, cg.available_bytes)
    return int(avail)


# ---------------------------------------------------------------------------- processes
def smaps_rollup(pid: int) -> dict[str, int] | None:
    """``/proc/<pid>/smaps_rollup`` in bytes by field, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024  # the kernel writes kB
    return out


def process_bytes(pid: int) -> int | None:
    """Memory of one process without its shared-memory mappings: ``Pss - Pss_Shmem`` (pages it
    shares with other processes split between them); psutil's unique set size where
    ``smaps_rollup`` is missing; None when the process is gone."""
    fields = smaps_rollup(pid)
    if fields is not None and "Pss" in fields:
        return max(0, fields["Pss"] - fields.get("Pss_Shmem", 0)) + fields.get("SwapPss", 0)
    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, AttributeError):
        return None


def mapped_segments(pid: int) -> set[str]:
    """Paths of the pipeline's shared-memory arenas (``/dev/shm/ttp_*``) that ``pid`` maps."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for raw in f:
                i = raw.find(b"/dev/shm/ttp_")
                if i >= 0:
                    found.add(raw[i:].decode("utf-8", "replace").split(" (deleted)")[0].strip())
    except OSError:
        pass
    return found


def segment_bytes(paths: Iterable[str]) -> int:
    """Bytes the kernel backs for the given ``/dev/shm`` files (written pages only)."""
    total = 0
    for path in set(paths):
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            continue  # unlinked since it was listed
    return total


# ---------------------------------------------------------------------------- the probe
@dataclass(frozen=True)
class MemoryReading:
    """One reading of the pipeline's memory (see the module docstring).

    Attributes:
        used_bytes: buffers + processes + consumer: ``Observation.memory_used_bytes``.
        buffers_bytes: bytes backing the arenas.
        processes_bytes: the workers' and the fork server's memory, arenas excluded, with the
            file of their stages' large arrays.
        consumer_bytes: what the consumer's process holds for the pipeline.
        stage_bytes: per stage name, what its workers hold (``StageStats.memory_bytes``).
        worker_bytes: per worker pid, what it holds.
        oom_kills: the cgroup's OOM-kill count (None when unknown).
        read_s: wall seconds this reading took.
    """

    used_bytes: int
    buffers_bytes: int
    processes_bytes: int
    consumer_bytes: int
    stage_bytes: dict[str, int] = field(default_factory=dict)
    worker_bytes: dict[int, int] = field(default_factory=dict)
    oom_kills: int | None = None
    read_s: float = 0.0


class MemoryProbe:
    """Reads the live pipeline's memory from ``/proc``, at most once per ``min_interval_s``.

    Args:
        consumer_bytes: what the consumer's process holds for the pipeline now.
        min_interval_s: a reading younger than this is returned again (a tuner and a
            progress display each observe every interval; the reading costs milliseconds
            per process); an older one is replaced by a fresh one before it is returned.
        cgroup_root, self_cgroup: where :func:`cgroup_memory` looks.

    Attributes:
        reads: readings taken so far; ``read_s_total``: the wall seconds they took.
    """

    def __init__(
        self,
        consumer_bytes: Callable[[], int] | None = None,
        min_interval_s: float = 0.5,
        cgroup_root: Path = CGROUP_ROOT,
        self_cgroup: Path = SELF_CGROUP,
    ):
        self._consumer = consumer_bytes
        self.min_interval_s = min_interval_s
        self._cgroup = (cgroup_root, self_cgroup)
        self._lock = threading.Lock()
        self._last: tuple[float, MemoryReading] | None = None
        self.reads = 0
        self.read_s_total = 0.0

    @property
    def last(self) -> MemoryReading | None:
        """The latest reading (None before the first)."""
        return self._last[1] if self._last is not None else None

    @property
    def mean_read_s(self) -> float:
        """Mean wall seconds per reading (0 before the first)."""
        return self.read_s_total / self.reads if self.reads else 0.0

    def read(self, snapshot: Snapshot) -> MemoryReading:
        """The pipeline's memory now; ``snapshot`` must list its workers
        (``Executor.snapshot(per_worker=True)``).

        A reading younger than ``min_interval_s`` is returned again; an older one is not: the
        caller waits for a fresh one (tens of milliseconds for processes that hold hundreds
        of megabytes), so that an observation reports the memory of when it is made, however
        long since the last one (a ``Loader.observe()`` seconds into an epoch, a tuner's
        first step). Callers at the same moment share one reading.
        """
        with self._lock:
            if self._last is None or time.monotonic() - self._last[0] >= self.min_interval_s:
                self._store(self._timed(snapshot))
            assert self._last is not None
            return self._last[1]

    def _timed(self, snapshot: Snapshot) -> MemoryReading:
        t0 = time.perf_counter()
        reading = self._read(snapshot)
        return dataclasses.replace(reading, read_s=time.perf_counter() - t0)

    def _store(self, reading: MemoryReading) -> None:
        self.reads += 1
        self.read_s_total += reading.read_s
        self._last = (time.monotonic(), reading)

    def _read(self, snapshot: Snapshot) -> MemoryReading:
        me = os.getpid()
        stage_bytes: dict[str, int] = {}
        worker_bytes: dict[int, int] = {}
        parents: set[int] = set()
        segments: set[str] = set()
        for stage in snapshot.stages:
            held = 0
            for w in stage.per_worker:
                # slot -1 is the sum of retired workers; a thread worker is this process.
                if w.slot < 0 or w.pid <= 0 or w.pid == me or w.pid in worker_bytes:
                    continue
                n = process_bytes(w.pid)
                if n is None:
                    continue  # gone since the snapshot
                worker_bytes[w.pid] = n
                held += n
                segments |= mapped_segments(w.pid)
                try:
                    parents.add(psutil.Process(w.pid).ppid())
                except psutil.Error:
                    pass
            stage_bytes[stage.name] = held
        # The fork server (the workers' parent, never this process) belongs to the pipeline.
        servers = sum(process_bytes(p) or 0 for p in parents - {me, 0, 1} - set(worker_bytes))
        # The large arrays of the stages' pickles, one file the workers share
        # (multiproc.buffers): what the workers hold, counted once, not a channel's buffer.
        pickled = {p for p in segments if p.endswith(FILE_SUFFIX)}
        buffers = segment_bytes(segments - pickled)
        consumer = int(self._consumer()) if self._consumer is not None else 0
        processes = sum(worker_bytes.values()) + servers + segment_bytes(pickled)
        cg = cgroup_memory(*self._cgroup)
        return MemoryReading(
            used_bytes=buffers + processes + consumer,
            buffers_bytes=buffers,
            processes_bytes=processes,
            consumer_bytes=consumer,
            stage_bytes=stage_bytes,
            worker_bytes=worker_bytes,
            oom_kills=cg.oom_kills if cg is not None else None,
        )
