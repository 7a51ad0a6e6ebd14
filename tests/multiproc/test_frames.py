"""Ordered delivery's reorder buffer and the inline accounting of frame queues."""

from __future__ import annotations

import collections

from multiproc.frames import MAX_INLINE_FRAMES, Frame, FrameQueue, Order


def _f(seq, inline=0):
    return Frame(id=hash(seq), seq=seq, payload=None, n=1, producer=0, inline=inline)


def test_frames_leave_in_sequence_whatever_order_they_arrive_in():
    order, out = Order(), collections.deque()
    units: dict = {}
    for seq in [(0, 0, 2), (0, 1, 0), (0, 0, 1), (0, 0, 0)]:
        order.put(_f(seq), out, units)
    assert [f.seq for f in out] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    units[(0, 0)] = 3  # unit 0 is done after three frames: unit 1 may follow
    order.drain(out, units)
    assert [f.seq for f in out][-1] == (0, 1, 0) and not order.frames


def test_an_empty_unit_does_not_hold_the_next_one():
    order, out = Order(), collections.deque()
    units = {(0, 0): 1, (0, 1): 0}
    order.put(_f((0, 2, 0)), out, units)
    order.put(_f((0, 0, 0)), out, units)
    assert [f.seq for f in out] == [(0, 0, 0), (0, 2, 0)]


def test_a_queue_counts_inline_bytes_and_frames():
    q = FrameQueue()
    q.append(_f((0, 0, 0), inline=100))
    q.appendleft(_f((0, 0, 1), inline=0))
    assert (q.inline, q.inline_frames) == (100, 1)
    assert q.full(100) and not q.full(101)
    q.popleft()
    q.popleft()
    assert (q.inline, q.inline_frames) == (0, 0)
    for k in range(MAX_INLINE_FRAMES):
        q.append(_f((0, 0, k), inline=1))
    assert q.full(1 << 30)
