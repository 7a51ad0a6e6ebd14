import json
import threading
import time

import pytest

from torchtune_pipe.tuning import (
    Allocation,
    HeuristicTuner,
    Limits,
    MiB,
    TuningLoop,
    run_episode,
)
from torchtune_pipe.tuning.base import ExecutorClosedError
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE, oversubscribe_factor
from torchtune_pipe.tuning.testing import LinearTunable

WAIT_S = 10.0  # generous deadline for events; tests normally finish in milliseconds


class SignallingTunable(LinearTunable):
    """Sets ``observed`` once ``target`` observations have happened."""

    def __init__(self, *args, target=3, **kw):
        super().__init__(*args, **kw)
        self.target = target
        self.calls = 0
        self.observed = threading.Event()

    def observe(self):
        obs = super().observe()
        self.calls += 1
        if self.calls >= self.target:
            self.observed.set()
        return obs


class FailingTuner(HeuristicTuner):
    name = "failing"

    def step(self, obs):
        raise RuntimeError("boom in step")


class ShiftingTuner(HeuristicTuner):
    """Alternates between two allocations so every step applies something new."""

    name = "shifting"

    def step(self, obs):
        w = (3, 1) if obs.t % 2 else (1, 3)
        return Allocation(w, (8 * MiB, 8 * MiB))


def test_loop_applies_logs_and_stops(tmp_path):
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=5)
    log_path = tmp_path / "decisions.jsonl"
    loop = TuningLoop(pipe, ShiftingTuner(), interval_s=0.005, log_path=str(log_path)).start()
    assert pipe.observed.wait(WAIT_S)
    loop.stop()
    assert not loop.running
    assert loop.steps >= 5 and pipe.applied[0].workers == (2, 2)  # reset: heuristic split
    assert {a.workers for a in pipe.applied[1:]} == {(3, 1), (1, 3)}
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(records) == loop.steps
    first = records[0]
    assert first["tuner"] == "shifting" and first["allocation"]["workers"] == [2, 2]
    assert set(first) >= {"t", "obs", "allocation", "tuner", "step_s", "applied"}
    assert set(first["obs"]) >= {"throughput", "cpus", "workers", "memory_used_bytes"}
    assert all(r["step_s"] >= 0 for r in records)
    assert 0.0 <= loop.cpu_fraction <= 1.0 and loop.cpu_s > 0.0
    assert loop.last_allocation == pipe.allocation


def test_loop_clamps_with_limits_fn():
    pipe = SignallingTunable((0.01, 0.02), cpus=64, target=2)
    limits = Limits(cpus=3, memory_bytes=4 * MiB)
    with TuningLoop(pipe, ShiftingTuner(), interval_s=0.005, limits_fn=lambda obs: limits):
        assert pipe.observed.wait(WAIT_S)
    # The limits' 3 CPUs, not the pipeline's 64, bound the workers (with the safety policy's
    # oversubscription for idle workers, tested exactly in test_baselines).
    cap = int(3 * MAX_OVERSUBSCRIBE)
    assert all(sum(a.workers) <= cap and sum(a.buffer_bytes) <= 4 * MiB for a in pipe.applied)


def test_tuner_exception_stops_the_loop_and_is_raised_by_stop(tmp_path):
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=2)
    log_path = tmp_path / "decisions.jsonl"
    loop = TuningLoop(pipe, FailingTuner(), interval_s=0.005, log_path=str(log_path)).start()
    assert pipe.observed.wait(WAIT_S)
    with pytest.raises(RuntimeError, match="boom in step"):
        loop.stop()
    assert isinstance(loop.error, RuntimeError) and not loop.running
    assert pipe.calls == 2  # nothing ran after the failing step
    last = json.loads(log_path.read_text().splitlines()[-1])
    assert last["error"] == "RuntimeError: boom in step"
    loop.stop()  # reported once; a second stop is quiet


class ClosingTunable(SignallingTunable):
    """A live pipeline's executor closed after ``closed_after`` observations."""

    def __init__(self, *args, closed_after=2, **kw):
        super().__init__(*args, **kw)
        self.closed_after = closed_after

    def observe(self):
        if self.calls >= self.closed_after:
            self.observed.set()
            raise ExecutorClosedError("Executor: snapshot() after close()")
        return super().observe()


def test_a_pipeline_closed_under_the_loop_ends_it_quietly(tmp_path, caplog):
    pipe = ClosingTunable((0.01, 0.02), cpus=4, target=99, closed_after=2)
    log_path = tmp_path / "decisions.jsonl"
    loop = TuningLoop(pipe, ShiftingTuner(), interval_s=0.005, log_path=str(log_path)).start()
    assert pipe.observed.wait(WAIT_S)
    loop.stop()  # its epoch ended (an error, a break): reported there, not by the loop
    assert loop.error is None and loop.steps == 2 and not loop.running
    assert "stopped by an error" not in caplog.text
    assert all("error" not in json.loads(line) for line in log_path.read_text().splitlines())


def test_a_pipeline_closed_before_the_loops_first_step_is_an_error():
    pipe = ClosingTunable((0.01, 0.02), cpus=4, closed_after=0)
    loop = TuningLoop(pipe, ShiftingTuner(), interval_s=0.005).start()
    assert pipe.observed.wait(WAIT_S)
    with pytest.raises(ExecutorClosedError):  # whoever started it handed it a closed one
        loop.stop()


def test_context_manager_surfaces_tuner_error():
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=2)
    with pytest.raises(RuntimeError, match="boom"):
        with TuningLoop(pipe, FailingTuner(), interval_s=0.005):
            assert pipe.observed.wait(WAIT_S)


def test_context_manager_keeps_the_callers_exception():
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=2)
    with pytest.raises(KeyError):
        with TuningLoop(pipe, FailingTuner(), interval_s=0.005) as loop:
            assert pipe.observed.wait(WAIT_S)
            raise KeyError("training failed")
    assert isinstance(loop.error, RuntimeError)


def test_lifecycle_errors():
    pipe = LinearTunable((0.01,), cpus=1)
    with pytest.raises(ValueError, match="interval_s must be positive"):
        TuningLoop(pipe, HeuristicTuner(), interval_s=0)
    loop = TuningLoop(pipe, HeuristicTuner(), interval_s=60.0)
    loop.stop()  # never started: nothing to do
    loop = TuningLoop(pipe, HeuristicTuner(), interval_s=60.0).start()
    with pytest.raises(RuntimeError, match="already started"):
        loop.start()
    loop.stop()  # wakes the 60 s wait at once
    assert not loop.running and loop.steps == 1


def test_run_episode_steps_and_clamps():
    pipe = LinearTunable((0.01, 0.02), cpus=4)
    trace = run_episode(pipe, ShiftingTuner(), steps=6)
    assert len(trace) == 6 and [o.t for o in trace] == [2, 3, 4, 5, 6, 7]
    assert pipe.applied[0].workers == (2, 2) and len(pipe.applied) == 7
    limits = Limits(cpus=2, memory_bytes=1 << 30)
    trace = run_episode(pipe, ShiftingTuner(), steps=3, limits_fn=lambda obs: limits)
    # Each decision is cut to the limits' 2 CPUs times the policy's factor for what it asked.
    for obs, a in zip(trace, pipe.applied[-3:], strict=True):
        assert sum(a.workers) <= max(2, int(2 * oversubscribe_factor(obs, a) + 0.5)) < 4
    with pytest.raises(ValueError, match="steps must be"):
        run_episode(pipe, ShiftingTuner(), steps=-1)


def test_run_episode_ends_on_oom():
    pipe = LinearTunable((0.01, 0.02), cpus=4, memory_limit_bytes=16 * MiB)
    # Heuristic buffers of 64 MiB per stage are clamped to the limit, so no OOM...
    assert len(run_episode(pipe, HeuristicTuner(), steps=4)) == 4
    # ...but a limit that drops below what is in use ends the episode.
    pipe.memory_limit_bytes = 1
    trace = run_episode(pipe, HeuristicTuner(), steps=4)
    assert len(trace) == 1 and trace[0].oom


def test_a_continued_loop_steps_instead_of_resetting():
    class CountingTuner(ShiftingTuner):
        resets = 0

        def reset(self, obs, start=None):
            CountingTuner.resets += 1
            return super().reset(obs, start)

    tuner = CountingTuner()
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=2)
    first = TuningLoop(pipe, tuner, interval_s=0.005).start()
    assert pipe.observed.wait(WAIT_S)
    first.stop()
    pipe.calls, pipe.observed = 0, threading.Event()
    second = TuningLoop(pipe, tuner, interval_s=0.005, reset=False).start()
    assert pipe.observed.wait(WAIT_S)
    second.stop()
    assert CountingTuner.resets == 1 and second.steps >= 2


def test_loop_fits_memory_once_per_decision(monkeypatch):
    from torchtune_pipe.tuning import safety

    calls = []
    fit = safety.fit_memory

    def counting(*args, **kw):
        calls.append(1)
        return fit(*args, **kw)

    monkeypatch.setattr(safety, "fit_memory", counting)
    pipe = SignallingTunable((0.01, 0.02), cpus=4, target=4)
    loop = TuningLoop(pipe, ShiftingTuner(), interval_s=0.005).start()
    assert pipe.observed.wait(WAIT_S)
    loop.stop()
    assert len(calls) == loop.steps == len(pipe.applied)


class CountingTuner(ShiftingTuner):
    def __init__(self):
        super().__init__()
        self.stepped_on = []

    def step(self, obs):
        self.stepped_on.append(obs.t)
        return super().step(obs)


def test_a_continued_loop_holds_on_its_first_interval_when_told(tmp_path):
    # The next epoch of a tuner whose last loop stepped since its first tick: the first
    # interval (the last epoch's drained end) is logged, nothing is applied, no step is taken.
    log_path = tmp_path / "decisions.jsonl"
    for hold in (True, False):
        pipe = SignallingTunable((0.01, 0.02), cpus=4, target=3)
        tuner = CountingTuner()
        loop = TuningLoop(
            pipe, tuner, interval_s=0.005, log_path=str(log_path), reset=False, hold_first=hold
        ).start()
        assert pipe.observed.wait(WAIT_S)
        loop.stop()
        first_t = json.loads(log_path.read_text().splitlines()[-loop.steps])["t"]
        assert (first_t not in tuner.stepped_on) == hold
        assert len(tuner.stepped_on) == loop.steps - (1 if hold else 0)
        assert len(pipe.applied) == len(tuner.stepped_on)


def test_a_loop_on_a_pipeline_started_anew_steps_first_on_the_last_ones_observation():
    # The next epoch's workers (non-persistent): the first tick steps on what the last
    # pipeline measured since its last tick, not on the new one's first milliseconds; with
    # nothing carried it is held.
    import dataclasses

    last = dataclasses.replace(SignallingTunable((0.01, 0.02), cpus=4, target=3).observe(), t=7.5)
    assert last.throughput > 0
    for carried, stepped_first in ((last, True), (None, False)):
        pipe = SignallingTunable((0.01, 0.02), cpus=4, target=3)
        tuner = CountingTuner()
        loop = TuningLoop(
            pipe, tuner, interval_s=0.005, reset=False, carried=lambda c=carried: c
        ).start()
        assert pipe.observed.wait(WAIT_S)
        loop.stop()
        assert (tuner.stepped_on[:1] == [7.5]) == stepped_first
        assert 7.5 not in tuner.stepped_on[1:]
        assert len(tuner.stepped_on) == loop.steps - (0 if stepped_first else 1)
        assert len(pipe.applied) == len(tuner.stepped_on)


class StartingTunable(SignallingTunable):
    """Delivers nothing over its first ``starting`` observations (its workers starting)."""

    def __init__(self, *args, starting, **kw):
        super().__init__(*args, **kw)
        self.starting = starting

    def observe(self):
        import dataclasses

        obs = super().observe()
        return dataclasses.replace(obs, throughput=0.0) if self.calls <= self.starting else obs


@pytest.mark.parametrize("reset, hold, carried", [(False, True, False), (False, False, True),
                                                  (True, False, False)])  # fmt: skip
def test_a_continued_loop_is_held_until_its_new_pipeline_delivers(reset, hold, carried):
    """A continued loop on a pipeline started anew steps on no interval before the pipeline's
    first item, however many intervals its start takes (the last pipeline's observation,
    where carried, is still stepped on first). A new loop's reset is its first decision, and
    its later intervals are all stepped on."""
    import dataclasses

    last = dataclasses.replace(SignallingTunable((0.01, 0.02), cpus=4).observe(), t=7.5)
    pipe = StartingTunable((0.01, 0.02), cpus=4, target=8, starting=4)
    tuner = CountingTuner()
    loop = TuningLoop(
        pipe, tuner, interval_s=0.005, reset=reset, hold_first=hold,
        carried=(lambda: last) if carried else None,
    ).start()  # fmt: skip
    assert pipe.observed.wait(WAIT_S)
    loop.stop()
    zero_ts = {1.0, 2.0, 3.0, 4.0}
    stepped_live = [t for t in tuner.stepped_on if t != 7.5]
    if reset:
        assert len(tuner.stepped_on) == loop.steps - 1 and zero_ts & set(tuner.stepped_on)
    else:
        assert not zero_ts & set(stepped_live) and len(stepped_live) >= 8 - 4 - 1
        assert (tuner.stepped_on[:1] == [7.5]) == carried


class RecordingTuner(ShiftingTuner):
    """Keeps every observation it was given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def step(self, obs):
        self.seen.append(obs)
        return super().step(obs)


def test_a_logged_decision_gives_back_the_observation_it_was_made_on(tmp_path):
    """Every field of every stage (CPU seconds per item, run queue, hops, ...) and of the
    observation is in the log, so a decision can be replayed through the planner."""
    import dataclasses

    from torchtune_pipe.tuning.loop import observation, read_log

    pipe = SignallingTunable((2e-6, 0.02), cpus=4, target=4)
    tuner = RecordingTuner()
    log_path = tmp_path / "decisions.jsonl"
    loop = TuningLoop(pipe, tuner, interval_s=0.005, log_path=str(log_path)).start()
    assert pipe.observed.wait(WAIT_S)
    loop.stop()
    records = read_log(log_path)[1:]  # the first decision is the reset's, on no step
    assert len(records) == len(tuner.seen) > 0
    for record, seen in zip(records, tuner.seen, strict=True):
        got = observation(record)
        for field in dataclasses.fields(seen):
            want, back = getattr(seen, field.name), getattr(got, field.name)
            if field.name == "stages":
                for s, b in zip(want, back, strict=True):
                    for f in dataclasses.fields(s):
                        x, y = getattr(s, f.name), getattr(b, f.name)
                        assert y == (
                            x if isinstance(x, (str, type(None))) else pytest.approx(x, rel=1e-3)
                        )
            else:
                approx = want if want is None else pytest.approx(want, rel=1e-3)
                assert back == approx, (field.name, want, back)


class SlowOnce(LinearTunable):
    """Its third observation takes ``slow_s``; notes when each one returns."""

    def __init__(self, *args, slow_s, **kw):
        super().__init__(*args, **kw)
        self.slow_s, self.returned = slow_s, []

    def observe(self):
        if len(self.returned) == 2:
            time.sleep(self.slow_s)
        obs = super().observe()
        self.returned.append(time.perf_counter())
        return obs


def test_a_late_observation_moves_the_schedule_instead_of_catching_up():
    """An observation that returns late (a busy machine, a slow memory reading) is followed by
    one a whole interval after it: never ticks milliseconds apart, measuring nothing."""
    pipe = SlowOnce((0.01, 0.02), cpus=4, slow_s=0.35)
    loop = TuningLoop(pipe, HeuristicTuner(), interval_s=0.1).start()
    deadline = time.monotonic() + WAIT_S
    while len(pipe.returned) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    gaps = [b - a for a, b in zip(pipe.returned, pipe.returned[1:], strict=False)]
    assert len(gaps) >= 5 and min(gaps) >= 0.09, gaps
