"""torch's intra-op threads on the threads that run stage code.

A worker process runs its stage with ``StageSpec.torch_threads`` intra-op threads (1 by
default, as torch's DataLoader workers): N workers each running N-thread kernels would
oversubscribe the cores. The threads that run stage code in a process of its own or in the
consumer's (thread workers, a worker's calls in flight, its read-ahead) start with the
interpreter's default instead, all the cores each; two of them running small kernels at once
were measured here at 5-275x slower than one alone (OpenMP teams spinning against each other).

Where torch's setting is the calling thread's own (the OpenMP backend: a thread's own
``nthreads`` ICV), :func:`set_here` gives such a thread the stage's count without touching the
consumer's; where it is the whole process's it leaves it alone.
"""

from __future__ import annotations

import sys
import threading

_per_thread: bool | None = None
_lock = threading.Lock()


def per_thread() -> bool:
    """Whether ``torch.set_num_threads`` sets the calling thread's count alone (found once, by
    setting another count on a short-lived thread and reading this one's)."""
    global _per_thread
    with _lock:
        if _per_thread is None:
            import torch

            mine = torch.get_num_threads()
            other = 2 if mine == 1 else 1
            t = threading.Thread(target=torch.set_num_threads, args=(other,), daemon=True)
            t.start()
            t.join()
            _per_thread = torch.get_num_threads() == mine
            if not _per_thread:
                torch.set_num_threads(mine)  # put the process's count back
        return _per_thread


def of_this_thread() -> int | None:
    """The calling thread's intra-op threads (None: torch is not imported here)."""
    torch = sys.modules.get("torch")
    return None if torch is None else int(torch.get_num_threads())


def set_here(n: int | None) -> None:
    """Give the calling thread ``n`` intra-op threads where the count is its own (None, or
    torch not imported: nothing)."""
    torch = sys.modules.get("torch")
    if n is None or torch is None or not per_thread():
        return
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


__all__ = ["of_this_thread", "per_thread", "set_here"]
