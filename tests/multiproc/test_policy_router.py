"""The router's decisions as pure functions (``policy``): which worker gets each queued frame
or unit, when a stage is done or flushed and a run finished, and when a worker is past its
stage's ``timeout_s``. No processes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from multiproc import policy
from multiproc.policy import Load, StageProgress

# ---------------------------------------------------------------- assign


def test_each_frame_goes_to_the_worker_with_the_most_room_counting_earlier_ones():
    # Loads 2, 0, 1 with 3 credits: rooms 1, 3, 2.
    assert policy.assign([Load(2), Load(0), Load(1)], credits=3, n=4) == [1, 1, 2, 0]


def test_frames_stop_at_the_first_that_no_worker_has_room_for():
    assert policy.assign([Load(1), Load(2)], credits=2, n=5) == [0]
    assert policy.assign([Load(2), Load(2)], credits=2, n=3) == []
    assert policy.assign([], credits=2, n=3) == []


def test_a_tie_goes_to_the_first_worker():
    assert policy.assign([Load(0), Load(0)], credits=1, n=2) == [0, 1]


def test_a_worker_reading_units_ahead_takes_as_many_more():
    # A source worker reading 3 units at once has room for credits + 2 in flight.
    assert policy.assign([Load(0, ahead=3), Load(0)], credits=1, n=5) == [0, 0, 0, 1]


def test_the_last_units_wait_for_the_workers_still_to_come():
    # Two units left, one worker to come: the ready one reads its first, not a second.
    assert policy.assign([Load(0)], credits=2, n=2, coming=1) == [0]
    # Three left: it takes two; the last waits for the worker to come.
    assert policy.assign([Load(0)], credits=3, n=3, coming=1) == [0, 0]
    # Frames (coming None) have no one to wait for.
    assert policy.assign([Load(0)], credits=2, n=2) == [0, 0]


def test_a_ready_worker_holding_nothing_takes_a_unit_whatever_is_coming():
    assert policy.assign([Load(1), Load(0)], credits=2, n=1, coming=5) == [1]


@dataclass
class Held:
    wid: int
    inflight: dict
    ahead: int = 1


@pytest.mark.parametrize("loads", [(0,), (1, 0), (2, 1, 0), (1, 1), (3, 0, 2)])
@pytest.mark.parametrize("credits", [1, 2, 3])
def test_assign_is_pick_worker_applied_item_by_item(loads, credits):
    workers = [Held(k, dict.fromkeys(range(n))) for k, n in enumerate(loads)]
    want = []
    for item in range(6):
        h = policy.pick_worker(workers, credits)
        if h is None:
            break
        h.inflight[("new", item)] = item
        want.append(h.wid)
    assert policy.assign([Load(n) for n in loads], credits, 6) == want


def test_workers_to_come_are_those_starting_empty_and_those_not_started():
    assert policy.coming_workers(starting_idle=1, target=4, active=3) == 2
    assert policy.coming_workers(starting_idle=0, target=2, active=3) == 0  # shrinking


# ---------------------------------------------------------------- progress

IDLE = StageProgress(
    done=False,
    stateful=False,
    busy=False,
    queued=False,
    starting=False,
    flush_sent=False,
    flushing=False,
    can_flush=True,
    held=False,
)
REDUCER = replace(IDLE, stateful=True)


def test_nothing_closes_before_every_unit_is_done():
    got = policy.progress([IDLE, IDLE], units_done=False, sink_parked=False)
    assert got == policy.Progress(closed={0: False})


def test_idle_stages_close_in_order_and_the_run_finishes():
    got = policy.progress([IDLE, IDLE, IDLE], units_done=True, sink_parked=False)
    assert got == policy.Progress(closed={0: True, 1: True, 2: True}, done=[0, 1, 2], finished=True)


@pytest.mark.parametrize("field", ["busy", "queued"])
def test_a_stage_with_work_holds_itself_and_the_stages_after_it(field):
    got = policy.progress([IDLE, replace(IDLE, **{field: True}), IDLE], True, False)
    assert got == policy.Progress(closed={0: True, 1: True}, done=[0])


def test_stages_after_the_first_not_done_are_not_read():
    def views():
        yield replace(IDLE, busy=True)
        raise AssertionError("read past a stage that holds the ones after it")

    assert policy.progress(views(), units_done=True, sink_parked=False).done == []


def test_stages_done_before_are_passed_over():
    done = replace(IDLE, done=True)
    got = policy.progress([done, done, IDLE], units_done=False, sink_parked=False)
    assert got == policy.Progress(closed={2: True}, done=[2], finished=True)


def test_frames_parked_before_the_consumer_hold_the_run():
    got = policy.progress([IDLE], units_done=True, sink_parked=True)
    assert got.done == [0] and not got.finished


def test_a_reducer_is_flushed_once_its_input_is_through():
    got = policy.progress([IDLE, REDUCER, IDLE], units_done=True, sink_parked=False)
    assert got == policy.Progress(closed={0: True, 1: True}, flush=[1], done=[0])


def test_a_reducer_with_a_worker_starting_waits_for_its_hello_before_flushing():
    got = policy.progress([IDLE, replace(REDUCER, starting=True)], True, False)
    assert got.flush == [] and got.done == [0]


def test_a_reducer_flushing_or_holding_frames_is_not_done():
    for now in (
        replace(REDUCER, flush_sent=True, flushing=True),
        replace(REDUCER, flush_sent=True, held=True),
    ):
        got = policy.progress([IDLE, now], True, False)
        assert got.flush == [] and got.done == [0] and not got.finished


def test_a_reducer_flushed_and_holding_nothing_is_done():
    got = policy.progress([IDLE, replace(REDUCER, flush_sent=True)], True, False)
    assert got == policy.Progress(closed={0: True, 1: True}, done=[0, 1], finished=True)


def test_a_reducer_with_no_ready_worker_is_flushed_and_done_at_once():
    # Its workers all retiring (or none alive): the flush reaches no one, nothing is held.
    got = policy.progress([IDLE, replace(REDUCER, can_flush=False), IDLE], True, False)
    assert got == policy.Progress(
        closed={0: True, 1: True, 2: True}, flush=[1], done=[0, 1, 2], finished=True
    )


# ---------------------------------------------------------------- timeouts


@dataclass(frozen=True)
class Busy:
    stage: str
    seconds: float


def test_workers_past_their_stages_timeout_are_overdue_in_the_order_given():
    busy = [Busy("udf", 9.0), Busy("read", 4.0), Busy("udf", 2.0), Busy("free", 99.0)]
    assert policy.overdue(busy, {"udf": 3.0, "read": 3.5}) == busy[:2]
    assert policy.overdue(busy, {"udf": 9.0}) == []  # at the limit is not past it


def test_the_next_deadline_is_the_soonest_limit_left():
    now = 10_000_000_000
    clocks = [(5.0, now - 2_000_000_000), (3.0, now - 1_000_000_000)]
    assert policy.next_deadline_s(now, clocks) == pytest.approx(2.0)


def test_a_worker_not_in_its_function_has_its_whole_limit_left():
    assert policy.next_deadline_s(10**9, [(4.0, 0)]) == 4.0


def test_a_deadline_passed_is_looked_at_again_shortly():
    assert policy.next_deadline_s(10 * 10**9, [(1.0, 1)]) == policy.MIN_DEADLINE_S


def test_no_deadline_without_workers_to_time():
    assert policy.next_deadline_s(10**9, []) is None


# ---------------------------------------------------------------- worker kinds

Mix = policy.Mix


def _plan(have, want):
    got = policy.resize_plan(have, want)
    return {k: (s.start, s.retire) for k, s in got.items() if s.start or s.retire}


def test_a_resize_starts_and_retires_each_kind_apart():
    # Local and offload workers, as offload.split planned them.
    assert _plan(Mix(2, 0, 1), Mix(1, 0, 3)) == {"process": (0, 1), "remote": (2, 0)}
    assert _plan(Mix(1, 0, 3), Mix(2, 0, 0)) == {"process": (1, 0), "remote": (0, 3)}
    # A move between processes and threads starts the new kind, retires the old one.
    assert _plan(Mix(3, 0, 0), Mix(0, 3, 0)) == {"process": (0, 3), "thread": (3, 0)}
    assert _plan(Mix(1, 2, 1), Mix(2, 1, 1)) == {"process": (1, 0), "thread": (0, 1)}
    assert _plan(Mix(2, 1, 0), Mix(2, 1, 0)) == {}


def test_threads_none_keeps_the_kind_a_stage_does_not_start_as():
    # A process stage running one thread keeps it, and its processes take the rest.
    assert policy.worker_mix(5, 0, None, Mix(2, 1, 0), starts_as_threads=False) == Mix(4, 1, 0)
    # A thread stage keeps its processes (none: it stays all threads as it grows).
    assert policy.worker_mix(4, 0, None, Mix(0, 2, 0), starts_as_threads=True) == Mix(0, 4, 0)
    assert policy.worker_mix(4, 0, None, Mix(1, 1, 0), starts_as_threads=True) == Mix(1, 3, 0)
    # At most the local count: offload workers take their part first.
    assert policy.worker_mix(3, 2, None, Mix(0, 3, 0), starts_as_threads=False) == Mix(0, 1, 2)
    assert policy.worker_mix(2, 0, None, Mix(3, 0, 0), starts_as_threads=True) == Mix(2, 0, 0)


def test_threads_given_split_the_local_workers():
    assert policy.worker_mix(4, 1, 2, Mix(4, 0, 0), starts_as_threads=False) == Mix(1, 2, 1)
    assert policy.worker_mix(4, 0, 0, Mix(0, 4, 0), starts_as_threads=True) == Mix(4, 0, 0)


def test_threads_are_checked_against_the_local_workers():
    assert policy.threads_problem(4, 1, None) is None
    assert policy.threads_problem(4, 1, 3) is None
    assert "[0, 3]" in (policy.threads_problem(4, 1, 4) or "")
    assert policy.threads_problem(4, 0, -1) is not None
    assert policy.threads_problem(4, 0, True) is not None  # type: ignore[arg-type]


def test_the_next_worker_is_of_a_kind_the_stage_is_short_of():
    assert policy.next_kind(Mix(1, 0, 0), Mix(1, 2, 0), "process") == "thread"
    assert policy.next_kind(Mix(0, 0, 0), Mix(1, 1, 0), "thread") == "process"
    assert policy.next_kind(Mix(1, 1, 0), Mix(1, 1, 0), "thread") == "thread"
