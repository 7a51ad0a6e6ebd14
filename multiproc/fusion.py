"""Fusion: a stage's function runs in the previous stage's workers, with no hop between them.

A *host* stage's worker is given, when spawned, the pickled specs of the stages after it that
may run in it (:func:`~multiproc.spec.fuse_blocker`: stateless, same worker type, at most
``stats.MAX_FUSED``). :meth:`Fusion.set_fused` marks a stage as fused into the one before it;
the router then tells each host's workers how many of the next stages to run too
(``protocol.Fuse``). A worker reports with every output which stage made it (its depth), and
the router delivers the frame past the stages it went through. So each frame is run by each
stage's function exactly once whether the switch happens before, during or after it: a frame
already queued for a stage that is now fused still runs there; a stage that is split again
gets its workers back before its host stops running its function.

A fused stage keeps no workers of its own once nothing is queued for it; its worker target is
kept for when it is split again. Each stage's time, items and errors stay its own (the host's
worker counts them in separate columns, ``stats.fused_col``), so tuners see every stage.
"""

from __future__ import annotations

from . import protocol as P
from . import stats
from .errors import SpecError
from .frames import WorkerState as WS
from .spec import FUSABLE_INTO, StageSpec, fuse_blocker, fusion_host


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
    processes): what :meth:`Fusion.set_fused` accepts one stage after the other. A pipeline
    whose tuner starts there is started in it, so that no worker is started for a stage only
    to be fused away in the first tuning step."""
    chain = chain_lengths(stages)
    fused = [s.fused for s in stages]
    for j in range(1, len(stages)):
        fused[j] = fused[j] or fuse_error(stages, chain, j, fused) is None
    return tuple(fused)


class Fusion:
    """Fusion state and decisions of the executor (see the module docstring)."""

    def _init_fusion(self) -> None:
        stages = self.spec.stages
        n = len(stages)
        self._chain_len = chain_lengths(stages)
        self._set_chains()
        self._fused = [s.fused for s in stages]
        for j in range(n):
            if self._fused[j] and (why := self._fuse_error(j, self._fused)) is not None:
                raise SpecError(f"stage {self._names[j]!r}: fused=True, but {why}")
        self._depth_sent = [self._depth(i) for i in range(n)]

    def _set_chains(self) -> None:
        """Each stage's workers' pickles of the stages after it they can run (from the stage
        pickles, :meth:`multiproc.lifecycle.Workers._pickle_stages`)."""
        self._chains = [
            tuple(self._stage_bytes[i + 1 : i + 1 + k]) for i, k in enumerate(self._chain_len)
        ]

    # ---------------------------------------------------------------- public API
    def fused(self) -> tuple[bool, ...]:
        """Per stage, whether it runs in the previous stage's workers."""
        return tuple(self._fused)

    def fusable(self) -> tuple[bool, ...]:
        """Per stage, whether :meth:`set_fused` may fuse it into the stage before it (given
        the stages fused now: a chain is at most ``stats.MAX_FUSED`` long)."""
        return tuple(self._fuse_error(j, self._fused) is None for j in range(len(self._fused)))

    def set_fused(self, stage: str | int, fused: bool) -> None:
        """Run ``stage``'s function in the previous stage's workers (True), or in its own
        workers again (False), while running; nothing is lost or run twice across the switch.

        Raises:
            SpecError: the stage cannot be fused into the one before it (says why).
        """
        j = self._stage_index(stage)
        if not isinstance(fused, bool):
            raise SpecError(f"set_fused(): fused must be a bool, got {fused!r}")
        with self._lock:
            self._check_open()
            if fused == self._fused[j]:
                return
            if fused:
                want = list(self._fused)
                want[j] = True
                why = self._fuse_error(j, want)
                if why is not None:
                    raise SpecError(f"set_fused(): cannot fuse stage {self._names[j]!r}: {why}")
            self._fused[j] = fused
        self._command(("fusion",))

    # ---------------------------------------------------------------- router side
    def _fuse_error(self, j: int, fused: list[bool]) -> str | None:
        return fuse_error(self.spec.stages, self._chain_len, j, fused)

    def _depth(self, i: int) -> int:
        """How many stages after ``i`` its workers run now (0 unless ``i`` hosts a group)."""
        if self._fused[i]:
            return 0
        d = 0
        while i + d + 1 < len(self._fused) and self._fused[i + d + 1]:
            d += 1
        return d

    def _apply_fusion(self) -> None:
        """Tell hosts' workers their depth; give split stages their workers back first."""
        for j, st in enumerate(self._stages):
            if not self._fused[j]:
                for _ in range(st.target - self._n_active(j)):
                    self._spawn(j)
        for i in range(len(self._stages)):
            d = self._depth(i)
            if d != self._depth_sent[i]:
                self._depth_sent[i] = d
                for h in self._active(i):
                    self._send(h, P.Fuse(d))

    def _settle_fusion(self) -> None:
        """A fused stage's workers retire once nothing is queued or running there; one is
        started if frames made before the switch arrive after they left."""
        for j, st in enumerate(self._stages):
            if not self._fused[j]:
                continue
            active = self._active(j)
            if st.ready:
                if not active and not any(
                    h.stage == j and h.state == WS.RETIRING for h in self._workers.values()
                ):
                    self._spawn(j)
            elif active and not any(h.inflight for h in active):
                for h in active:
                    h.state = WS.RETIRING
                    self._send(h, P.Retire())

    def _fused_rows(self, j: int, now: int) -> list[stats.WorkerStats]:
        """Stage ``j``'s work done in other stages' workers, as rows of counters."""
        rows = []
        for d in range(1, stats.MAX_FUSED + 1):
            i = j - d
            if i < 0:
                break
            st = self._stages[i]
            sources = [self._counters.row(slot) for slot in sorted(st.slots)]
            if st.retired is not None:
                sources.append(st.retired)
            for r in sources:
                if r[stats.fused_col(d, stats.F_ITEMS_IN)]:
                    rows.append(stats.read_fused(self._names[j], r, d))
        return rows
