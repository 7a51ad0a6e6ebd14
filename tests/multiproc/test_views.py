"""Every tensor and array arrives with its own values, whatever view of whatever buffer it is.

Property-based: hypothesis draws views of larger buffers (offsets, steps, transposes, expands,
overlapping windows, negative numpy strides, conjugates, every dtype, 0 elements to more than
a frame) nested in tuples, lists, dicts, dataclasses and TensorDicts, and checks them after the
transport alone (in-band, arena, inline) and after a trip through a real 3-stage executor.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiproc import Executor, ExecutorSpec, StageSpec, arena, serialize

from . import _fns, _views
from ._views import array_views, assert_equal, build, payloads

# Bounded so the default suite stays fast; raise with HYPOTHESIS_EXAMPLES=1000 for a soak.
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "60"))
PROPS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# A 160 KB view at offset 1000 of a bigger buffer: larger than "same"'s 32 KiB per worker.
LARGE = ("torch", "float64", 1000, [20_000], (("slice", 0, 5, None, 1),))


@pytest.mark.parametrize(
    "make, want",
    [
        (lambda: torch.arange(1000)[5], torch.tensor(5)),
        (lambda: torch.arange(1000)[5:9], torch.tensor([5, 6, 7, 8])),
        (lambda: torch.arange(2000).reshape(20, 100)[3], torch.arange(300, 400)),
    ],
    ids=["element", "slice", "row"],
)
def test_a_view_arrives_with_its_own_values(make, want):
    assert_equal(serialize.loads(*serialize.dumps(make())), want)


def _sent_bytes(obj) -> int:
    header, buffers = serialize.dumps(obj)
    return len(header) + sum(serialize.buffer_nbytes(buffers))


def test_a_row_of_a_large_table_sends_the_row_not_the_table():
    table = torch.arange(4_000_000, dtype=torch.float32).reshape(40_000, 100)  # 16 MB
    assert _sent_bytes(table[123]) < 2048
    assert _sent_bytes(table[1000:1010]) < 4000 + 1024
    # A column is compacted: its 40,000 elements, not the 16 MB they are spread over.
    assert _sent_bytes(table[:, 7]) < 40_000 * 4 + 1024
    arr = table.numpy()
    assert _sent_bytes(arr[123]) < 2048
    assert _sent_bytes(arr[::-1, 3]) < 40_000 * 4 + 1024


def _arena_roundtrip(obj, seg: arena.Segment):
    alloc = arena.Allocator(seg.size, seg.size)
    payload, _ = arena.encode(obj, alloc, seg)
    released = []
    out = arena.decode(payload, arena.MappingCache(), released.append)
    return out


@pytest.fixture
def segment():
    seg = arena.Segment(f"ttp_{os.getpid()}_views_test", 64 << 20, create=True)
    try:
        yield seg
    finally:
        seg.view.release()
        seg.mm.close()
        seg.unlink()


@PROPS
@given(recipe=array_views("torch"))
def test_tensor_views_roundtrip(recipe):
    want = build(recipe)
    assert_equal(serialize.loads(*serialize.dumps(want)), want)
    # Only the bytes the view covers travel (never the whole padded buffer).
    assert _sent_bytes(want) <= 2 * want.numel() * want.element_size() + 1024


@PROPS
@given(recipe=array_views("numpy"))
def test_numpy_views_roundtrip(recipe):
    want = build(recipe)
    assert_equal(serialize.loads(*serialize.dumps(want)), want)
    assert _sent_bytes(want) <= 2 * want.nbytes + 1024


def test_nested_views_roundtrip_inline_and_in_an_arena(segment):
    @PROPS
    @given(recipe=payloads)
    def check(recipe):
        want = build(recipe)
        # Inline frames (in the control message) and arena frames (in shared memory).
        inline, _ = arena.encode(want, None, None)
        assert_equal(arena.decode(inline, arena.MappingCache(), None), want)
        assert_equal(_arena_roundtrip(want, segment), want)

    check()


@pytest.mark.parametrize("worker_type", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_nested_views_through_a_three_stage_executor(worker_type):
    """The source builds real views in the worker; a small budget on the middle stage sends
    large frames down the spill path, small ones inline, the rest through arenas."""
    spec = ExecutorSpec(
        (
            StageSpec("build", "source", _views.emit_built, frame_items=2, worker_type=worker_type),
            StageSpec(
                "same",
                "map",
                _fns.identity,
                workers=2,
                buffer_bytes=64 * 1024,
                worker_type=worker_type,
            ),
            StageSpec("again", "map", _fns.identity, worker_type=worker_type),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:

        @settings(PROPS, max_examples=max(10, EXAMPLES // 3))
        @given(recipes=st.lists(payloads, min_size=1, max_size=6))
        def check(recipes):
            recipes = [*recipes, LARGE]  # one frame bigger than a worker's whole budget
            got = list(ex.run([tuple(recipes)]))
            assert_equal(got, [build(r) for r in recipes])

        check()
        assert ex.snapshot().stage("same").spilled > 0  # the spill path was taken


def test_views_redelivered_after_a_worker_dies_keep_their_values(tmp_path):
    """The frame a killed worker held is delivered again from the arena: still its values."""
    recipes = tuple(
        ("torch", "int64", 1000 + 37 * i, [50, 40], (("select", 0, i % 50),)) for i in range(40)
    )
    spec = ExecutorSpec(
        (
            StageSpec("build", "source", _views.emit_built, frame_items=4),
            StageSpec("die", "map", _fns.DieOnceOnFirst(str(tmp_path / "died")), workers=1),
            StageSpec("again", "map", _fns.identity),
        ),
        ordered=True,
        max_restarts=4,
    )
    with Executor(spec) as ex:
        got = list(ex.run([recipes]))
        assert sum(s.restarts for s in ex.snapshot().stages) == 1
    assert_equal(got, [build(r) for r in recipes])
    assert (tmp_path / "died").exists()


def test_bool_bf16_complex_views_and_empty_tensors():
    base = torch.arange(100)
    cases = [
        (base % 2 == 0)[3::4],
        base.bfloat16()[10:20].view(2, 5).t(),
        (base.double() + 1j * base.double())[7:].conj(),
        torch.empty(0, 4)[:, 1:],
        base[50:50],
        np.arange(100)[::-7],
        np.arange(100.0).reshape(10, 10)[2:, 3].astype(np.float16)[::-1],
    ]
    for want in cases:
        assert_equal(serialize.loads(*serialize.dumps(want)), want)


def test_small_tensors_arrive_as_writable_copies_with_their_dtype_and_shape():
    # Tensors under INBAND_MAX_BYTES travel as their bytes (a row of a few small tensors is
    # the common item); anything that path does not cover takes the general one.
    table = torch.arange(64, dtype=torch.float64).reshape(8, 8)
    cases = [
        table[3],  # a row view at a storage offset
        torch.tensor(7),  # 0-d
        torch.arange(12, dtype=torch.int8).reshape(3, 4),
        torch.tensor([True, False, True]),
        table[:3, :3].t(),  # small but not contiguous
        torch.arange(6).bfloat16(),  # a dtype numpy lacks
        torch.ones(3, requires_grad=True),
    ]
    for want in cases:
        got = serialize.loads(*serialize.dumps(want))
        assert_equal(got, want)
        assert got.requires_grad == want.requires_grad
        if not got.requires_grad:
            got.zero_()  # writable, and not the sender's memory
    assert table[3, 0].item() == 24.0


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_default_collate_in_a_worker_gives_torchs_values_without_a_segment(worker_type):
    """In a worker, process or thread, torch's collate stacks into ordinary memory (the
    channel copies it into its arena, or hands it over within the process; a segment per
    tensor bought nothing). The caller's process gets torch's own entry back once its thread
    workers are gone."""
    from torch.utils.data._utils import collate

    before = collate.default_collate_fn_map[torch.Tensor]
    spec = ExecutorSpec(
        (
            StageSpec("src", "source", _fns.read_range, worker_type=worker_type),
            StageSpec("collate", "map", _fns.collate_as_a_worker, worker_type=worker_type),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        got = list(ex.run([(0, 4)]))
    assert [b.tolist() for b, _ in got] == [[[x] * 3, [x + 1] * 3] for x in range(4)]
    assert not any(shared for _, shared in got)
    assert collate.default_collate_fn_map[torch.Tensor] is before


def test_a_tensor_collate_a_user_registered_is_kept(monkeypatch):
    from torch.utils.data._utils import collate

    def mine(batch, *, collate_fn_map=None):
        return torch.stack(batch)

    monkeypatch.setitem(collate.default_collate_fn_map, torch.Tensor, mine)
    serialize.collate_into_private_memory()
    assert collate.default_collate_fn_map[torch.Tensor] is mine


def test_a_hop_is_timed_for_what_it_pickles_and_copies():
    big = [(0, 0, torch.ones(1 << 20))]  # 4 MiB
    assert serialize.hop_s(big) > 0.0
    assert serialize.hop_s(big, arena_bytes=1 << 20) > 0.0  # a frame bigger than its arena
    assert serialize.hop_s([(0, 0, lambda: 1)]) == 0.0  # does not pickle: no hop to make
    assert serialize.hop_s([]) == 0.0
