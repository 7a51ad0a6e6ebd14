"""Running a script in a fresh interpreter, and what it leaves behind once it has ended.

For the faults a test process cannot suffer itself: being forked while a loader exists, being
killed by a signal, exiting without ``close()``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM = "/dev/shm"


def _as_from_a_shell() -> None:
    """In the child, before exec: SIGINT and SIGTERM at their defaults and no signal blocked,
    as a program started from a shell has them, whatever this test process holds."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def start(code: str, **kw) -> subprocess.Popen:
    """Start ``python -c code`` with this checkout's packages first on the path, its signals
    as a shell would start it (:func:`_as_from_a_shell`)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_shell,
        **kw,
    )


def run(code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``code`` to its end (killing it after ``timeout_s``); stdout, stderr, returncode."""
    p = start(code)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        raise AssertionError(f"script hung for {timeout_s} s; stderr:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def tree(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def processes(pids) -> list[psutil.Process]:
    """psutil handles of those of ``pids`` that exist (0: a row of retired workers)."""
    out = []
    for q in pids:
        try:
            if q > 0:
                out.append(psutil.Process(q))
        except psutil.Error:
            pass
    return out


def kill_tree(pid: int) -> None:
    for q in tree(pid):
        try:
            psutil.Process(q).kill()
        except psutil.Error:
            pass


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as ended)."""
    out = set()
    for q in pids:
        try:
            if psutil.Process(q).status() != psutil.STATUS_ZOMBIE:
                out.add(q)
        except psutil.Error:
            pass
    return out


def segments(pid: int) -> set[str]:
    """The ``ttp_*`` segments named after process ``pid``."""
    prefix = f"ttp_{pid}_"
    return {n for n in os.listdir(SHM) if n.startswith(prefix)}


def wait_gone(pids: set[int], pid: int, within_s: float) -> tuple[set[int], set[str]]:
    """Wait up to ``within_s`` for ``pids`` to end and ``pid``'s segments to go; what is left."""
    deadline = time.monotonic() + within_s
    while True:
        left, segs = running(pids), segments(pid)
        if (not left and not segs) or time.monotonic() > deadline:
            return left, segs
        time.sleep(0.05)  # polling with a deadline: another tree's exits have no event here


def cleanup(pids: set[int], pid: int) -> None:
    """Kill what a failed test left running and unlink its segments."""
    for q in running(pids):
        try:
            psutil.Process(q).kill()
        except psutil.Error:
            pass
    for name in segments(pid):
        try:
            os.unlink(os.path.join(SHM, name))
        except OSError:
            pass


def leftovers(
    code: str, ready: str, sig: int | None = None, within_s: float = 5.0
) -> tuple[int, str, set[int], set[str]]:
    """Run ``code`` until it prints the line ``ready``, send it ``sig`` (None: let it exit
    by itself), and report its exit status, its stderr, and the processes of its tree and
    segments of its pid still there ``within_s`` after it ended."""
    p = start(code)
    pids: set[int] = set()
    try:
        line = p.stdout.readline().strip()
        assert line == ready, f"expected {ready!r}, got {line!r}: {p.stderr.read()[-3000:]}"
        pids = tree(p.pid)
        if sig is not None:
            p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        left, segs = wait_gone(pids, p.pid, within_s)
        return p.returncode, err, left, segs
    finally:
        cleanup(pids | {p.pid}, p.pid)
        if p.returncode is None:
            p.communicate()
