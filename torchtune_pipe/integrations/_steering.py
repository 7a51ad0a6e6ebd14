"""Steering a loader's pipeline with one tuner across pauses, restarts and ranks.

Framework-free pieces of the training integrations: a :class:`Session` keeps one tuner across
every tuning loop started during a fit, a :class:`RankView` shows a rank its share of the host,
and :class:`Steering` starts, restarts and stops the loop on a loader.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from torchtune_pipe.loader.core import Loader
from torchtune_pipe.loader.running import consumer_labels
from torchtune_pipe.tuning.base import Allocation, Observation, Tunable, Tuner
from torchtune_pipe.tuning.loop import TuningLoop

log = logging.getLogger(__name__)


class Session:
    """One tuner across every loop started during a fit.

    The first ``reset`` starts the tuner (from a restored allocation when resuming); a loop
    started later (after a pause, or on a rebuilt executor) re-applies the last decision
    instead of starting over. A lock makes ``state_dict`` safe against a concurrent step.
    """

    def __init__(self, tuner: Tuner):
        self.tuner = tuner
        self.name = str(getattr(tuner, "name", type(tuner).__name__))
        self.lock = threading.Lock()
        self.started = False
        self.restored: Allocation | None = None
        self.last: Allocation | None = None

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        with self.lock:
            if self.started and self.last is not None:
                return self.last
            self.started = True
            start, self.restored = start or self.restored, None
            if start is not None and len(start.workers) != len(obs.stages):
                log.warning(
                    "TuningCallback: restored allocation has %d stages, the pipeline %d; "
                    "starting the tuner afresh", len(start.workers), len(obs.stages),
                )  # fmt: skip
                start = None
            self.last = self.tuner.reset(obs, start=start)
            return self.last

    def step(self, obs: Observation) -> Allocation:
        with self.lock:
            self.last = self.tuner.step(obs)
            return self.last


class RankView:
    """The loader's pipeline as this rank's tuner sees it: its share of the host's CPUs and
    memory (``share`` ranks per host), and the model's measured step time as the consumer
    latency."""

    def __init__(self, inner: Tunable, share: int, step_s: Callable[[], float], history: Any):
        self.inner = inner
        self.share = max(1, share)
        self.step_s = step_s
        self.history = history
        self.last: Observation | None = None

    def observe(self) -> Observation:
        obs = self.inner.observe()
        limit = obs.memory_limit_bytes // self.share
        step = self.step_s()
        obs = dataclasses.replace(
            obs,
            cpus=obs.cpus / self.share,
            memory_limit_bytes=limit,
            consumer_step_s=step if step > 0 else obs.consumer_step_s,
            oom=obs.oom or obs.memory_used_bytes > limit,
        )
        self.last = obs
        self.history.append(obs)
        return obs

    def apply(self, allocation: Allocation) -> None:
        self.inner.apply(allocation)


class Steering:
    """Runs (and restarts) a tuning loop on one loader for one session."""

    def __init__(self, session: Session, interval_s: float, log_path: str | None):
        self.session = session
        self.interval_s = interval_s
        self.log_path = log_path
        self.loop: TuningLoop | None = None
        self.inner: Tunable | None = None
        self.view: RankView | None = None

    def ensure(self, loader: Loader, share: int, step_s: Callable[[], float], history) -> None:
        tunable = loader.tunable
        if tunable is None:
            return  # not iterated yet: no pipeline runs
        if self.loop is not None and self.inner is tunable:
            if self.loop.error is not None:
                self.stop(raise_error=True)
            return
        self.stop(raise_error=True)  # a rebuilt executor: end the loop on the old one
        self.inner = tunable
        self.view = RankView(tunable, share, step_s, history)
        self.loop = TuningLoop(
            self.view, self.session, self.interval_s, self.log_path,
            labels=consumer_labels(loader.pipeline),
        ).start()  # fmt: skip

    def stop(self, raise_error: bool) -> None:
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.stop(raise_error=raise_error)

    @property
    def allocation(self) -> Allocation | None:
        return self.session.last
