"""A stateful worker started after ``run(units, epoch)`` began must see that epoch.

A stateful worker that replaces a crashed one (or is added by ``resize``) builds its reducer
with ``fn(epoch, index)``; were it built for epoch 0, a seeded shuffle would change its order
after a crash, even in ordered mode.
"""

from __future__ import annotations

import os

from multiproc import Executor, ExecutorSpec, StageSpec


def _read(unit):
    return [unit]


class _DieOnce:
    """Reducer factory: tags items with the epoch it was built for; the first worker dies."""

    def __init__(self, flag: str):
        self.flag = flag

    def __call__(self, epoch=0, worker=0):
        return _Tagger(epoch, self.flag)


class _Tagger:
    def __init__(self, epoch, flag):
        self.epoch, self.flag = epoch, flag

    def push(self, tag, item):
        if item == 3 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os._exit(1)  # a crash: the executor starts a replacement worker
        return [([tag], (self.epoch, item))]

    def flush(self):
        return []

    def drain(self):
        return []


def test_replacement_stateful_worker_sees_the_runs_epoch(tmp_path):
    spec = ExecutorSpec(
        (
            StageSpec("src", "source", _read),
            StageSpec("tag", "stateful", _DieOnce(str(tmp_path / "died")), max_workers=1),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        out = list(ex.run(range(6), epoch=5))
    assert sorted(x for _, x in out) == list(range(6))
    assert {e for e, _ in out} == {5}
