"""Fusion: a stage's function runs in the previous stage's workers, with no hop between them.

A *host* stage's worker is given, when spawned, the specs of the stages after it that may run
in it (:func:`~multiproc.spec.fuse_blocker`: stateless, starting as the same worker type, at
most ``stats.MAX_FUSED``), each in the form its own kind of worker takes (process or thread,
:func:`~multiproc.lifecycle.pickle_stages`): the fused stages run in the host's workers of
whatever kind they are now. :meth:`FusionControl.switch` (``Executor.set_fused``) marks a
stage as fused into the one before it; the router then tells each host's workers how many of
the next stages to run too (``protocol.Fuse``). A worker reports with every output which
stage made it (its depth), and the router delivers the frame past the stages it went through.
So each frame is run by each stage's function exactly once whether the switch happens
before, during or after it: a frame already queued for a stage that is now fused still runs
there; a stage that is split again gets its workers back before its host stops running its
function.

A fused stage keeps no workers of its own once nothing is queued for it; its worker target is
kept for when it is split again. Each stage's time, items and errors stay its own (the host's
worker counts them in separate columns, ``stats.fused_col``), so tuners see every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from . import protocol as P
from . import stats
from .errors import SpecError
from .lifecycle import WorkerPool
from .mail import Mail
from .spec import FUSABLE_INTO, StageSpec, fuse_blocker, fused_depth, fusion_host
from .state import ExecutorState

T = TypeVar("T")


def chain_lengths(stages: list[StageSpec] | tuple[StageSpec, ...]) -> list[int]:
    """For each stage, how many of the stages after it its workers can run."""
    n, out = len(stages), []
    for i, host in enumerate(stages):
        k = 0
        while (
            i + k + 1 < n
            and k < stats.MAX_FUSED
            and stages[i + k + 1].kind in FUSABLE_INTO
            and fuse_blocker(host, stages[i + k + 1]) is None
        ):
            k += 1
        out.append(k)
    return out


def chain_pickles(forms: Sequence[T], chain: list[int]) -> list[tuple[T, ...]]:
    """Per stage, the forms of the stages after it that its workers can run (``chain``,
    :func:`chain_lengths`), out of every stage's form for one kind of worker ``forms``
    (:func:`multiproc.lifecycle.pickle_stages`)."""
    return [tuple(forms[i + 1 : i + 1 + k]) for i, k in enumerate(chain)]


def fuse_error(
    stages: list[StageSpec] | tuple[StageSpec, ...], chain: list[int], j: int, fused: list[bool]
) -> str | None:
    """Why stage ``j`` cannot run in the workers of the stage before it, given the stages
    marked in ``fused`` and each stage's :func:`chain_lengths` ``chain``; None when it can."""
    if j == 0:
        return "the first stage has no stage before it"
    why = fuse_blocker(stages[j - 1], stages[j])
    if why is not None:
        return why
    host = fusion_host(fused, j - 1)
    if j - host > chain[host]:
        return (
            f"stage {stages[host].name!r} can run at most {chain[host]} stages after it "
            f"({stats.MAX_FUSED} at most, each stateless and like it)"
        )
    return None


def fuse_all(stages: list[StageSpec] | tuple[StageSpec, ...]) -> tuple[bool, ...]:
    """``stages``' shape with every stage fused that may be, in pipeline order (the fewest
    processes): what :meth:`FusionControl.switch` accepts one stage after the other. A pipeline
    whose tuner starts there is started in it, so that no worker is started for a stage only
    to be fused away in the first tuning step."""
    chain = chain_lengths(stages)
    fused = [s.fused for s in stages]
    for j in range(1, len(stages)):
        fused[j] = fused[j] or fuse_error(stages, chain, j, fused) is None
    return tuple(fused)


def check_fused(stages: list[StageSpec] | tuple[StageSpec, ...]) -> None:
    """Raise SpecError naming the first stage with ``fused=True`` that cannot start fused."""
    chain = chain_lengths(stages)
    fused = [s.fused for s in stages]
    for j, s in enumerate(stages):
        if fused[j] and (why := fuse_error(stages, chain, j, fused)) is not None:
            raise SpecError(f"stage {s.name!r}: fused=True, but {why}")


class FusionControl:
    """Which stages run fused, and the router's side of a switch (see the module docstring).
    Callers hold the executor's lock."""

    def __init__(self, state: ExecutorState, mail: Mail, pool: WorkerPool) -> None:
        self.state = state
        self.mail = mail
        self.pool = pool
        stages = state.spec.stages
        # Per stage, how many of the stages after it its workers can run (chain_lengths).
        self.chain_len = chain_lengths(stages)
        # Per stage, the depth its workers were last told (protocol.Fuse; at spawn, the one
        # of then).
        self.depth_sent = [fused_depth(state.fused, i) for i in range(len(stages))]
        # Per stage, fused as of the last apply (a split takes effect there).
        self.applied = list(state.fused)

    def fused(self) -> tuple[bool, ...]:
        """Per stage, whether it runs in the previous stage's workers."""
        return tuple(self.state.fused)

    def running_fused(self, j: int) -> bool:
        """Whether stage ``j`` runs in its host's workers now, as a snapshot reports it: from
        a switch to fused on (its own workers drain meanwhile), and until the router gives a
        stage switched to split its workers back (:meth:`apply`); its host's workers run it
        until then."""
        return self.state.fused[j] or self.applied[j]

    def fusable(self) -> tuple[bool, ...]:
        """Per stage, whether :meth:`switch` may fuse it into the stage before it (given
        the stages fused now: a chain is at most ``stats.MAX_FUSED`` long)."""
        fused = self.state.fused
        return tuple(self._error(j, fused) is None for j in range(len(fused)))

    def switch(self, j: int, fused: bool) -> bool:
        """Mark stage ``j`` as run in the previous stage's workers (True) or in its own (False).

        Returns:
            Whether that changed anything (then the router is to :meth:`apply` it).

        Raises:
            SpecError: the stage cannot be fused into the one before it (says why).
        """
        now = self.state.fused
        if fused == now[j]:
            return False
        if fused:
            want = list(now)
            want[j] = True
            why = self._error(j, want)
            if why is not None:
                name = self.state.names[j]
                raise SpecError(f"set_fused(): cannot fuse stage {name!r}: {why}")
        now[j] = fused
        return True

    def _error(self, j: int, fused: list[bool]) -> str | None:
        return fuse_error(self.state.spec.stages, self.chain_len, j, fused)

    def apply(self) -> None:
        """Tell hosts' workers their depth; give split stages their workers back first."""
        state, pool = self.state, self.pool
        for j in range(len(state.stages)):
            if not state.fused[j]:
                pool.fill(j)
        for i in range(len(state.stages)):
            d = fused_depth(state.fused, i)
            if d != self.depth_sent[i]:
                self.depth_sent[i] = d
                for h in pool.active(i):
                    self.mail.send(h, P.Fuse(d))
        self.applied = list(state.fused)

    def settle(self) -> None:
        """A fused stage's workers retire once nothing is queued or running there; one is
        started if frames made before the switch arrive after they left."""
        state, pool = self.state, self.pool
        for j, st in enumerate(state.stages):
            if not state.fused[j]:
                continue
            active = pool.active(j)
            if st.ready:
                if not active and not pool.retiring(j):
                    pool.spawn(j, pool.next_kind(j))
            elif active and not any(h.inflight for h in active):
                for h in active:
                    pool.retire(h)

    def fused_rows(self, j: int, now: int) -> list[stats.WorkerStats]:
        """Stage ``j``'s work done in other stages' workers, as rows of counters."""
        state = self.state
        rows = []
        for d in range(1, stats.MAX_FUSED + 1):
            i = j - d
            if i < 0:
                break
            st = state.stages[i]
            sources = [state.counters.row(slot) for slot in sorted(st.slots)]
            if st.retired is not None:
                sources.append(st.retired)
            for r in sources:
                if r[stats.fused_col(d, stats.F_ITEMS_IN)]:
                    rows.append(stats.read_fused(state.names[j], r, d))
        return rows
