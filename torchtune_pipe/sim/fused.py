"""Which stages of a simulated pipeline may fuse: the live rule (:mod:`multiproc.fusion`).

:class:`FusionRule` is the part of :class:`~torchtune_pipe.sim.model.SimPipeline` that says
which stages may run in the previous stage's workers (stateless maps after a source or map
stage, at most ``MAX_FUSED`` after one host, ``StageModel.fusable``), and the widest such
shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from multiproc.spec import EXECUTOR_KIND, FUSABLE_INTO, FUSION_HOSTS
from torchtune_pipe.tuning.base import fusion_host

from .workload import StageModel


class FusionRule:
    """Fusion rule of a simulated pipeline (uses ``self.workload``)."""

    def fusable(self, fused: Sequence[bool] | None = None) -> tuple[bool, ...]:
        """Per stage, whether it may be fused into the stage before it, given the stages fused
        in ``fused`` (default: now); a fused stage is fusable. The live rule
        (``multiproc.fusion``): a fusable ``"map"`` after a ``"source"`` or ``"map"``, at most
        ``MAX_FUSED`` stages run in one host's workers."""
        state = list(self._s.fused if fused is None else fused)
        out = []
        for j in range(self.n_stages):
            want = list(state)
            want[j] = True
            out.append(self._fuse_error(j, want) is None)
        return tuple(out)

    def widest_fusion(self) -> tuple[bool, ...]:
        """Every stage that may be fused fused, in pipeline order (the fewest hops)."""
        fused = [False] * self.n_stages
        for j in range(1, self.n_stages):
            fused[j] = True
            fused[j] = self._fuse_error(j, fused) is None
        return tuple(fused)

    def _fuse_error(self, j: int, fused: Sequence[bool]) -> str | None:
        """Why stage ``j`` cannot run fused under ``fused`` (None: it can), as live."""
        if j == 0:
            return "the first stage has no stage before it"
        st = self.workload.stages
        if not can_host(st[j - 1], st[j]):
            return f"stage {st[j].name!r} cannot run in the workers of {st[j - 1].name!r}"
        host = fusion_host(fused, j - 1)
        if j - host > self._chain_len[host]:
            return (
                f"stage {st[host].name!r} can run at most {self._chain_len[host]} stages after it"
            )
        return None

    def _last(self, i: int, fused: Sequence[bool]) -> int:
        """The last stage of the group hosted by stage ``i`` (``i`` when none is fused)."""
        while i + 1 < self.n_stages and fused[i + 1]:
            i += 1
        return i


def can_host(host: StageModel, stage: StageModel) -> bool:
    """Whether ``stage`` may run in the workers of ``host``, the stage before it: the live
    rule (``multiproc.spec.fuse_blocker``) on the executor kinds the simulator's kinds map to."""
    kind = EXECUTOR_KIND.get(host.kind)  # type: ignore[call-overload]
    return (
        stage.fusable and kind in FUSION_HOSTS and EXECUTOR_KIND.get(stage.kind) in FUSABLE_INTO  # type: ignore[call-overload]
    )
