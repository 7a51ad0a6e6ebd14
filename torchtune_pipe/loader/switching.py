"""A shorter interpreter switch interval while an executor is built beside inline reads.

A fast start reads units in the consumer's thread while a background thread builds the
executor (:mod:`~torchtune_pipe.loader.faststart`). The build mostly waits (on the fork server,
on each worker's hello) and runs a little Python between its waits; a read that holds the
interpreter lock (a tokenizer in pure Python) keeps it for the whole switch interval
(``sys.getswitchinterval()``, 5 ms by default) each time the build asks for it back. Some
twenty such hand-overs made a build of ~40 ms take 125-140 ms beside the ``jsonl`` zoo
member's reads, every epoch of non-persistent workers, with one core idle meanwhile.
:func:`quick_switches` lowers the interval to ``BUILD_SWITCH_S`` while any build runs and puts
back what it found once the last one is over (unless something else changed it meanwhile).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

BUILD_SWITCH_S = 0.0005

_lock = threading.Lock()
_active = 0
_saved: float | None = None


@contextlib.contextmanager
def quick_switches() -> Iterator[None]:
    """Within: the switch interval at most ``BUILD_SWITCH_S`` (nested and concurrent uses
    count; the interval found by the first is restored by the last)."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            if _saved > BUILD_SWITCH_S:
                sys.setswitchinterval(BUILD_SWITCH_S)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                if _saved > BUILD_SWITCH_S and sys.getswitchinterval() == BUILD_SWITCH_S:
                    sys.setswitchinterval(_saved)
                _saved = None
