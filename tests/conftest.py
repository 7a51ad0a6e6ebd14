"""Suite-wide guards: every test must leave no child process and no /dev/shm entry behind."""

from __future__ import annotations

import multiprocessing.forkserver as _fs
import multiprocessing.resource_tracker as _rt
import os
import sys
import time

import psutil
import pytest
import torch

SHM = "/dev/shm"


def _service_pids() -> set[int]:
    """Long-lived helpers multiprocessing keeps for the whole session (not leaks)."""
    pids = set()
    fs_pid = getattr(_fs._forkserver, "_forkserver_pid", None)
    if fs_pid:
        pids.add(fs_pid)
    rt_pid = getattr(_rt._resource_tracker, "_pid", None)
    if rt_pid:
        pids.add(rt_pid)
    return pids


# Processes of a Ray cluster a test module starts (tests/test_remote.py): its daemons (GCS,
# raylets, their agents) and the worker processes they start and reuse at will. They are the
# cluster's, not ours; that module checks its actors and the cluster's resources instead, and
# that the cluster's processes are gone when it shuts it down.
_RAY_MARKS = ("ray::", "/ray/_private/", "/ray/core/", "/ray/dashboard/", "/ray/autoscaler/")


def is_ray_process(cmdline: list[str], name: str) -> bool:
    """Whether a process belongs to a Ray cluster (by its name or command line)."""
    text = " ".join(cmdline[:3])
    return name in ("raylet", "gcs_server") or any(m in text for m in _RAY_MARKS)


def _children(include_ray: bool = False) -> dict[int, str]:
    me = psutil.Process()
    services = _service_pids()
    ray_loaded = "ray" in sys.modules  # no Ray process without it
    out = {}
    for p in me.children(recursive=True):
        if p.pid in services:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = p.cmdline()
            if ray_loaded and not include_ray and is_ray_process(cmdline, p.name()):
                continue
            out[p.pid] = " ".join(cmdline[:3])
        except psutil.Error:
            continue
    return out


def _shm() -> set[str]:
    """This session's segments: the executor names every segment after the creating pid, so
    other processes on the machine (parallel test runs) cannot cause false alarms."""
    prefix = f"ttp_{os.getpid()}_"
    try:
        return {n for n in os.listdir(SHM) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a child process or a shared-memory segment behind."""
    before_children = set(_children())
    before_shm = _shm()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = {p: c for p, c in _children().items() if p not in before_children}
        new_shm = _shm() - before_shm
        if (not left and not new_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling with a deadline: process exit has no portable event here
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    for name in new_shm:
        try:
            os.unlink(os.path.join(SHM, name))
        except OSError:
            pass
    assert not left, f"test left child processes behind: {left}"
    assert not new_shm, f"test left shared-memory segments behind: {sorted(new_shm)}"


@pytest.fixture
def one_thread():
    """Tiny nets: extra intra-op threads only add contention on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Modules whose tests import Ray (test_dqn.py through torchrl, which imports it). A process
# that has imported Ray spawns its workers instead of forking them from a snapshot
# (multiproc.servers.fork_unsafe), so every loader a test builds after them would: they run
# last, whatever order they were collected in.
_IMPORT_RAY = ("test_dqn.py", "test_remote.py", "test_remote_mixed.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in _IMPORT_RAY)  # stable: the rest keep order
