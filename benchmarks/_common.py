"""Helpers shared by the benchmark scripts: tables, JSON output, machine facts, timing."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any


def fmt(value: Any, digits: int = 3) -> str:
    """Render one table cell: floats with ``digits`` significant digits, bools as pass/FAIL."""
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if abs(value) >= 10**digits:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if value is None:
        return "-"
    return str(value)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    title: str | None = None,
    print_fn: Callable[[str], None] = print,
) -> str:
    """Print ``rows`` (dicts) as an aligned text table with the given columns, in order.

    Missing cells print as ``-``. Returns the table text (also handed to ``print_fn``).

    Example:
        >>> _ = print_table([{"a": 1, "b": 2.5}], ["a", "b"], print_fn=lambda s: None)
    """
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(
                v.rjust(w) if num else v.ljust(w)
                for v, w, num in zip(row, widths, numeric, strict=True)
            ).rstrip()
        )
    text = "\n".join(lines)
    print_fn(text)
    return text


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN/inf
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return _jsonable(obj.item())
    return str(obj)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (dataclasses, tuples and numpy scalars converted),
    creating parent folders; the file is replaced atomically. Returns the path written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=2) + "\n")
    os.replace(tmp, p)
    return p


def usable_cores() -> int:
    """CPUs this process may run on (affinity mask), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts that make a benchmark number comparable: CPUs, memory, versions, time.

    Versions come from the installed packages' metadata, not their import: a harness that
    measures its children's PSS must map none of their libraries (``benchmarks/_peers_data.py``).
    """
    import psutil

    vm = psutil.virtual_memory()
    freq = psutil.cpu_freq()
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "cpu_mhz": round(freq.current) if freq else None,
        "memory_total_bytes": vm.total,
        "memory_available_bytes": vm.available,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "torchdata": _version("torchdata"),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return info


def median(values: Sequence[float]) -> float:
    """Median of the finite values, NaN when there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, linear interpolation), NaN for no values."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


class SteadyClock:
    """Times the middle of a stream: items ``lo`` to ``hi`` of ``n`` (10% to 90% by default),
    so start-up and draining do not count. Call :meth:`tick` once per item received.

    Args:
        n: items the stream will deliver.
        head: fraction skipped at the start; tail: fraction skipped at the end.
    """

    def __init__(self, n: int, head: float = 0.1, tail: float = 0.1):
        if n < 2:
            raise ValueError(f"SteadyClock: n must be >= 2, got {n}")
        self.lo = max(1, int(n * head))
        self.hi = max(self.lo + 1, min(n, n - int(n * tail)))
        self.count = 0
        self.t_lo = self.t_hi = None

    def tick(self, k: int = 1) -> None:
        """Count ``k`` items just received."""
        before = self.count
        self.count += k
        if before < self.lo <= self.count:
            self.t_lo = time.perf_counter()
        if before < self.hi <= self.count:
            self.t_hi = time.perf_counter()

    def rate(self) -> float:
        """Items per second between the two marks (NaN if the stream ended early)."""
        if self.t_lo is None or self.t_hi is None or self.t_hi <= self.t_lo:
            return float("nan")
        return (self.hi - self.lo) / (self.t_hi - self.t_lo)


def _proc_cpu_s(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _machine_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuWindow:
    """CPU seconds used over a window by some processes, by this process (all its threads),
    and by the whole machine: what makes a rate readable on a shared, noisy host.

    Args:
        pids: other processes to account (e.g. worker processes); all their threads count.
    """

    def __init__(self, pids: Sequence[int] = ()):
        self.pids = [p for p in pids if p and p != os.getpid()]
        self._t0 = time.perf_counter()
        self._procs0 = {p: _proc_cpu_s(p) for p in self.pids}
        self._self0 = time.process_time()
        self._machine0 = _machine_busy_s()

    def stop(self) -> dict[str, float]:
        """Seconds since the start: ``wall_s``, ``procs_cpu_s`` (the given pids),
        ``self_cpu_s`` (this process), ``machine_busy_cores`` (all processes, in cores)."""
        wall = time.perf_counter() - self._t0
        procs = sum(max(0.0, _proc_cpu_s(p) - c0) for p, c0 in self._procs0.items())
        return {
            "wall_s": wall,
            "procs_cpu_s": procs,
            "self_cpu_s": time.process_time() - self._self0,
            "machine_busy_cores": (_machine_busy_s() - self._machine0) / wall if wall > 0 else 0.0,
        }
