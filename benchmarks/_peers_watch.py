"""The peers benchmark's watch on one contender's process tree: proportional memory (PSS, so
shared pages count once) and CPU time, sampled from the parent; the ``rescale`` plan (CPUs
taken away and given back with ``os.sched_setaffinity`` on every thread of the tree) and the
``memory`` scenario's watchdog (a tree grown past its allowance is killed, as the kernel's
OOM killer would)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

_SAMPLE_S = 0.25
# Reading a process's PSS (/proc/PID/smaps_rollup) costs ~4 ms of CPU: every 4th sample only,
# or the harness takes several % of the machine from tools that run many processes.
_PSS_EVERY = 4


@dataclass
class TreeWatch:
    """What the watcher saw of one contender's process tree."""

    peak_pss_bytes: int = 0
    cpu_s: dict[int, float] = field(default_factory=dict)
    cpu_at_first: dict[int, float] | None = None
    t_first: float | None = None
    t_last: float | None = None
    killed: str | None = None
    affinity_events: list[tuple[float, int]] = field(default_factory=list)
    pss_at_first: int | None = None


def tree_of(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (empty when it has ended)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def set_affinity(procs: list[psutil.Process], cpus: list[int]) -> None:
    """Pins every thread of ``procs`` to ``cpus``."""
    # Per thread: sched_setaffinity(pid) moves only a process's main thread, and thread pools
    # (tf.data, SPDL, torch) are started before the CPUs are taken away.
    for p in procs:
        try:
            tids = [t.id for t in p.threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass  # the thread ended between listing and setting


def watch_tree(proc: subprocess.Popen, plan: dict, done: threading.Event, out: TreeWatch) -> None:
    """Samples the tree's CPU times every ``_SAMPLE_S`` and its PSS every ``_PSS_EVERY``
    samples (``plan["pss_every"]`` where given: short runs want more) until ``done``; applies
    the rescale plan and the memory cap."""
    all_cpus = sorted(os.sched_getaffinity(0))
    pss_every = plan.get("pss_every", _PSS_EVERY)
    first_marker = plan["first_marker"]
    t_first = None
    tick = 0
    while not done.wait(_SAMPLE_S):
        procs = tree_of(proc.pid)
        pss, tick = 0, tick + 1
        for p in procs:
            try:
                if tick % pss_every == 0:
                    pss += p.memory_full_info().pss
                t = p.cpu_times()
                out.cpu_s[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        out.peak_pss_bytes = max(out.peak_pss_bytes, pss)
        growth = plan.get("mem_growth_bytes")
        if growth and pss and t_first is not None and out.pss_at_first is None:
            out.pss_at_first = pss
        if growth and pss and out.pss_at_first and pss > out.pss_at_first + growth:
            if out.killed is None:
                out.killed = (
                    f"killed by the memory watchdog: tree PSS {pss >> 20} MiB, "
                    f"{(pss - out.pss_at_first) >> 20} MiB past its {out.pss_at_first >> 20} MiB "
                    f"at the first batch (allowed {growth >> 20})"
                )
            for p in reversed(procs):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        if t_first is None and os.path.exists(first_marker):
            t_first = out.t_first = time.monotonic()
            out.cpu_at_first = dict(out.cpu_s)
        out.t_last = time.monotonic()
        if plan.get("rescale") and t_first is not None and len(all_cpus) > 1:
            since = time.monotonic() - t_first
            stage = (
                0
                if since < plan["duration_s"] / 3
                else (1 if since < plan["duration_s"] * 2 / 3 else 2)
            )
            want = 1 if stage == 1 else len(all_cpus)
            if not out.affinity_events or out.affinity_events[-1][1] != want or stage == 1:
                set_affinity(procs, all_cpus[:want])  # new workers inherit it from the parent
                if not out.affinity_events or out.affinity_events[-1][1] != want:
                    out.affinity_events.append((round(since, 2), want))


def remove_segments(pids: list[int]) -> None:
    """Removes the shared-memory segments of a tree that was killed (named after the pid)."""
    prefixes = tuple(f"ttp_{pid}_" for pid in pids)
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
    except FileNotFoundError:
        return
    for n in names:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass


def cpu_util_of(w: TreeWatch, cores: int) -> float | None:
    """Share of the usable CPUs the tree used during the timed window (after the first batch)."""
    if w.cpu_at_first is None or w.t_last is None or w.t_last <= w.t_first:
        return None
    used = sum(v - w.cpu_at_first.get(pid, 0.0) for pid, v in w.cpu_s.items())
    return used / (w.t_last - w.t_first) / cores
