"""Which stages of a simulated pipeline may fuse: the live rule (:mod:`multiproc.fusion`).

:class:`FusionRule` says which stages of a workload may run in the previous stage's workers
(stateless maps after a source or map stage, at most ``MAX_FUSED`` after one host,
``StageModel.fusable``), the widest such shape, and which stages a fused group holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from multiproc.spec import EXECUTOR_KIND, FUSABLE_INTO, FUSION_HOSTS
from multiproc.stats import MAX_FUSED
from torchtune_pipe.sim.workload import StageModel
from torchtune_pipe.tuning.base import fusion_host


class FusionRule:
    """The fusion rule of a workload (see the module docstring).

    Args:
        stages: the workload's stages, in pipeline order.
    """

    def __init__(self, stages: Sequence[StageModel]) -> None:
        self.stages = tuple(stages)
        n = len(self.stages)
        # For each stage, how many of the stages after it its workers could run (live rule).
        self.chain_len: list[int] = []
        for i, host in enumerate(self.stages):
            k = 0
            while i + k + 1 < n and k < MAX_FUSED and can_host(host, self.stages[i + k + 1]):
                k += 1
            self.chain_len.append(k)

    def fusable(self, fused: Sequence[bool]) -> tuple[bool, ...]:
        """Per stage, whether it may be fused into the stage before it, given the stages fused
        in ``fused``; a fused stage is fusable. The live rule (``multiproc.fusion``): a
        fusable ``"map"`` after a ``"source"`` or ``"map"``, at most ``MAX_FUSED`` stages run
        in one host's workers."""
        state = list(fused)
        out = []
        for j in range(len(self.stages)):
            want = list(state)
            want[j] = True
            out.append(self.error(j, want) is None)
        return tuple(out)

    def widest(self) -> tuple[bool, ...]:
        """Every stage that may be fused fused, in pipeline order (the fewest hops)."""
        fused = [False] * len(self.stages)
        for j in range(1, len(self.stages)):
            fused[j] = True
            fused[j] = self.error(j, fused) is None
        return tuple(fused)

    def error(self, j: int, fused: Sequence[bool]) -> str | None:
        """Why stage ``j`` cannot run fused under ``fused`` (None: it can), as live."""
        if j == 0:
            return "the first stage has no stage before it"
        st = self.stages
        if not can_host(st[j - 1], st[j]):
            return f"stage {st[j].name!r} cannot run in the workers of {st[j - 1].name!r}"
        host = fusion_host(fused, j - 1)
        if j - host > self.chain_len[host]:
            return f"stage {st[host].name!r} can run at most {self.chain_len[host]} stages after it"
        return None

    def last(self, i: int, fused: Sequence[bool]) -> int:
        """The last stage of the group hosted by stage ``i`` (``i`` when none is fused)."""
        while i + 1 < len(self.stages) and fused[i + 1]:
            i += 1
        return i


def can_host(host: StageModel, stage: StageModel) -> bool:
    """Whether ``stage`` may run in the workers of ``host``, the stage before it: the live
    rule (``multiproc.spec.fuse_blocker``) on the executor kinds the simulator's kinds map to."""
    kind = EXECUTOR_KIND.get(host.kind)  # type: ignore[call-overload]
    return (
        stage.fusable and kind in FUSION_HOSTS and EXECUTOR_KIND.get(stage.kind) in FUSABLE_INTO  # type: ignore[call-overload]
    )
