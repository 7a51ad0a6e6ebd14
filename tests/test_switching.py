"""The switch interval a fast start lowers while its executor is built."""

from __future__ import annotations

import sys
import threading

from torchtune_pipe.loader.switching import BUILD_SWITCH_S, quick_switches


def test_lowered_within_and_put_back_after_the_last_of_nested_and_concurrent_uses():
    before = sys.getswitchinterval()
    assert before > BUILD_SWITCH_S
    inside = threading.Event()
    leave = threading.Event()

    def other_build():
        with quick_switches():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other_build)
    with quick_switches():
        assert sys.getswitchinterval() == BUILD_SWITCH_S
        t.start()
        assert inside.wait(10)
        with quick_switches():
            assert sys.getswitchinterval() == BUILD_SWITCH_S
    assert sys.getswitchinterval() == BUILD_SWITCH_S  # the other build still runs
    leave.set()
    t.join()
    assert sys.getswitchinterval() == before


def test_an_interval_set_meanwhile_is_left_as_set():
    before = sys.getswitchinterval()
    try:
        with quick_switches():
            sys.setswitchinterval(0.002)  # the program's own choice, made while a build runs
        assert sys.getswitchinterval() == 0.002
    finally:
        sys.setswitchinterval(before)
