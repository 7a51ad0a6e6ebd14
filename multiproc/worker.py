"""The loop every stage worker runs (in a process or a thread).

A worker talks only to the executor, over its own private pipe: it never shares a lock or a
queue with other workers, so one killed at any instant cannot corrupt anything the others
use. It takes frames (or, for the source, work units), runs the stage function, writes the
results into its own arena, and commits them with one message. Releasing an input happens only
after the outputs made from it are committed, so the executor can re-deliver whatever a dead
worker held.

The messages, both ways, are the classes of :mod:`multiproc.protocol`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

from . import arena, concurrency, inherit, intraop, lifetime, policy, reducers, serialize, stats
from . import protocol as P
from .arena import Allocator, MappingCache, Segment
from .chain import Chain, call_stage
from .emit import Emitter
from .items import estimated_size, exc_payload, short_repr
from .link import Link
from .readahead import ReadAhead
from .spec import Skipped

log = logging.getLogger(__name__)

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns
_mono_ns = time.monotonic_ns  # the clock of IN_FN_SINCE_NS, shared with the executor
_here = threading.local()  # .thread_worker: this thread is a thread worker of an executor


def in_thread_worker() -> bool:
    """Whether the calling thread is a worker of an executor that runs as a thread of the
    executor's own process (so what it sets process-wide, the consumer sees)."""
    return getattr(_here, "thread_worker", False)


def act_as_thread_worker(on: bool = True) -> None:
    """Make the calling thread count as a thread worker (:func:`in_thread_worker`), or no
    longer: a thread of the consumer's process that reads as one would (a loader measuring its
    reads on threads) then leaves what is process-wide alone, as a thread worker does."""
    _here.thread_worker = on


# A unit still being read has its time counted at most this often (as RunQueue reads).
BOOK_EVERY_NS = 20_000_000
# How long a thread worker that ends waits for its calls' and reads' threads (the calls they
# run now finish; the executor's close waits for the worker within its own timeout).
THREADS_JOIN_S = 2.0


class _Exit(BaseException):
    """The executor told this worker to end (``P.Exit``). Not an ``Exception``: the handlers
    of what a stage's function raised (a unit's generator that failed, a frame that does not
    pickle) must not take it for one, report it as the stage's error and go on waiting."""


class _Worker:
    """One stage worker: the loop over its link's messages, the stage's kinds, the counters.

    Its collaborators get what they use in ``__init__``: the :class:`~multiproc.link.Link`
    (its pipe), the :class:`~multiproc.emit.Emitter` (its outputs into its arena), the
    :class:`~multiproc.chain.Chain` (the stages fused into its own) and the
    :class:`~multiproc.readahead.ReadAhead` (a source's units read side by side).
    """

    def __init__(
        self,
        conn: Connection,
        stage_box: list[Any],
        wid: int,
        slot: int,
        index: int,
        stats_name: str,
        n_slots: int,
        seg_name: str,
        seg_size: int,
        budget: int,
        chain: tuple[Any, ...] = (),
        sink_depth: int = -1,
    ) -> None:
        # The stage's pickle comes in a list emptied here: a tuple of arguments stays alive on
        # the stack of the process's run() for the worker's whole life, and a map-style
        # dataset's pickle can be as large as the dataset. A thread worker may get the spec
        # itself, shared with the executor's process (inherit.resolve): not its own.
        self.stage, self.owns_stage = inherit.resolve(stage_box.pop())
        self.wid = wid
        self.index = index
        self.counters = stats.CounterTable(stats_name, n_slots, create=False)
        self.row = self.counters.row(slot)
        self.row[:] = 0
        # Written per item: a memoryview store costs a fraction of a numpy one.
        self.cell = self.row.data
        self.row[stats.PID] = os.getpid()
        self.row[stats.STARTED_NS] = time.monotonic_ns()
        self.seg = Segment(seg_name, seg_size, create=False, writer=True)
        self.alloc = Allocator(seg_size, budget)
        self.shrunk = False  # the budget shrank: release free pages once frames fit it
        self.cache = MappingCache()
        self.started = False
        self.reducer: Any = None  # a stateful stage's, for this epoch (built on its first frame)
        self.epoch = 0
        self.calls = concurrency.CallPool(self.stage.concurrency, self.stage.max_concurrency)
        self.thread_worker = False  # set by worker_main; thread workers share torch's settings
        self.runq = stats.RunQueue(enabled=False)  # opened by loop(), in the worker's thread
        self.unit_clock = (0, 0)  # wall and CPU clocks when the unit's time was last counted
        self.link = Link(conn, wid, self.row)
        # A thread worker hands the frames it makes for the consumer over as they are.
        self.emitter = Emitter(
            self.link,
            self.alloc,
            self.seg,
            self.row,
            self.cell,
            self._handle_control,
            self._error,
            sink_depth,
        )
        # Fusion: the specs of the next stages this worker may run too (as its own is given).
        self.chain = Chain(chain, index, self.row, self.calls, self._error)
        # A source's units read side by side.
        self.readahead = ReadAhead(
            self.calls,
            self.link,
            self.cell,
            self._handle_control,
            self._commit_unit,
            self._add_own_time,
        )

    # -- plumbing ---------------------------------------------------------------------------
    def _release_free(self) -> None:
        """After the budget shrank: give the arena's free pages back (written pages of a
        shared-memory file stay resident until released), once frames fit the new budget."""
        self.shrunk = False
        for start, size in self.alloc.free_blocks():
            self.seg.release(start, size)

    def _handle_control(self, msg: Any) -> bool:
        """Handle a message that needs no stage work; False if it must wait its turn."""
        match msg:
            case P.Free(offsets):
                for off in offsets:
                    self.alloc.free(off)
                if self.shrunk and self.alloc.used <= self.alloc.limit:
                    self._release_free()
            case P.Budget(nbytes):
                limit = min(self.alloc.size, nbytes)
                self.shrunk = limit < self.alloc.limit
                self.alloc.limit = limit
                if self.shrunk and self.alloc.used <= limit:
                    self._release_free()
            case P.Concurrency(n):
                self.calls.set_width(n)
            case P.Fuse(depth):
                self.chain.set_depth(depth)
            case P.Drop(segment):
                self.cache.drop(segment)
            case P.Exit():
                raise _Exit
            case P.SpillOk():
                pass  # only meaningful while blocked
            case P.Epoch(epoch):
                self.epoch = epoch
                self.reducer = None
            case _:
                return False
        return True

    def _error(self, frame_id: Any, exc: BaseException, where: str, depth: int = 0) -> bool:
        """Report or count a failure of the function of the stage ``depth`` after this
        worker's own (fusion); True when processing may go on."""
        if depth:
            stage = self.chain.stages[depth - 1]
            self.row[stats.fused_col(depth, stats.F_ERRORS)] += 1
        else:
            stage = self.stage
            self.row[stats.ERRORS] += 1
        if stage.on_error == "skip":
            # The executor counts, logs and bounds skips (max_errors); only errors cost this.
            self.link.say(P.Skipped(self.wid, where, type(exc).__name__, str(exc)[:300], depth))
            return True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        text, tname = str(exc), type(exc).__name__
        self.link.say(P.Error(self.wid, frame_id, exc_payload(exc), tname, text, tb, where, depth))
        return False

    # -- stage kinds -----------------------------------------------------------------------
    def run_unit(self, unit_id: int, unit: Any, skip_frames: int) -> None:
        self.unit_clock = (_ns(), _cpu_ns())
        cell = self.cell
        cell[stats.IN_FN_SINCE_NS] = _mono_ns()
        self.calls.take_not_items()  # none is this unit's
        try:
            self._commit_unit(
                unit_id, unit, skip_frames, self.stage.fn(unit), on_frame=self._book_unit
            )
        finally:
            cell[stats.IN_FN_SINCE_NS] = 0
            cell[stats.WORK_ID] = cell[stats.WORK_ITEM] = 0
            self._add_own_time(*self.unit_clock)

    def _book_unit(self) -> None:
        """Count the unit's time so far, at most every ``BOOK_EVERY_NS``: a unit can take an
        epoch (an ``IterableDataset``'s shard), and counted only at its end, every interval
        before would read busy with no CPU, as if the stage waited on I/O."""
        t0, c0 = self.unit_clock
        if _ns() - t0 < BOOK_EVERY_NS:
            return
        self._add_own_time(t0, c0)
        self.unit_clock = (_ns(), _cpu_ns())
        self.cell[stats.IN_FN_SINCE_NS] = _mono_ns()

    def _commit_unit(
        self,
        unit_id: int,
        unit: Any,
        skip_frames: int,
        items: Iterable[Any],
        ahead: int = 1,
        on_frame: Callable[[], None] | None = None,
    ) -> None:
        """Frame ``items`` (what the stage function made of ``unit``), commit the frames
        after the first ``skip_frames`` (calling ``on_frame()`` after each), and say the unit
        is done (and that ``ahead`` units are being read at once)."""
        fi = self.stage.frame_items
        k = 0
        buf: list[Any] = []
        cell = self.cell
        cell[stats.WORK_ID] = unit_id + 1
        cell[stats.WORK_ITEM] = 1  # per frame, not per item: a store per item costs ~30 ns
        try:
            for item in items:
                if type(item) is Skipped:  # the source recovered from a failing item
                    if not self._error(
                        unit_id, item.error, f"work unit {short_repr(unit)}, {item.where}"
                    ):
                        return
                    continue
                buf.append(item)
                if k == 0 and fi > 1 and len(buf) == 2:
                    # Sized from the unit's first item, measured only when a second one comes
                    # (a unit of one item, e.g. a DataLoader batch, is one frame anyway).
                    fi = policy.frame_items(estimated_size(buf[0]), fi)
                while len(buf) >= fi:
                    frame, buf = buf[:fi], buf[fi:]
                    if k >= skip_frames and not self._send_unit_frame(unit_id, k, frame, unit):
                        return
                    k += 1
                    cell[stats.WORK_ITEM] = k * fi + 1
                    if on_frame is not None:
                        on_frame()
                    self._take_waiting_control()
            if buf:
                if k >= skip_frames and not self._send_unit_frame(unit_id, k, buf, unit):
                    return
                k += 1
        except Exception as e:
            # A generator that raised cannot go on: keep what it made, skip the rest.
            n = k * fi + len(buf)
            where = f"work unit {short_repr(unit)}, after item {n}: the rest of the unit"
            if buf and k >= skip_frames and not self._send_unit_frame(unit_id, k, buf, unit):
                return
            if buf:
                k += 1
            if not self._error(unit_id, e, where):
                return
        self.row[stats.FRAMES_IN] += 1
        self.link.say(P.UnitDone(self.wid, unit_id, k, self.link.take_frees(), ahead))

    def _take_waiting_control(self) -> None:
        """Between the frames of a unit, handle the control messages already waiting, without
        waiting for any: a unit can last an epoch (an ``IterableDataset``'s shard), and an
        ``Exit`` (an epoch ended early), a new budget or freed blocks must reach it before its
        next frame, not at its end. Other messages wait their turn (``link.deferred``)."""
        link = self.link
        while link.ready():
            try:
                msg = link.read()
            except (EOFError, ConnectionError):
                raise _Exit from None  # the executor is gone
            if not self._handle_control(msg):
                link.deferred.append(msg)

    def _add_own_time(self, t0: int, c0: int) -> None:
        """Count the time since ``t0`` (wall) and ``c0`` (CPU) as this stage's, less what
        fused stages' functions took (counted as theirs)."""
        chain_ns, chain_cpu_ns = self.chain.take_time()
        self.row[stats.BUSY_NS] += _ns() - t0 - chain_ns
        self.row[stats.CPU_NS] += _cpu_ns() - c0 - chain_cpu_ns + self.calls.take_cpu_ns()
        calls = self.calls.take_calls()
        if calls is not None:
            self.row[stats.CALL_N : stats.CALL_SXY + 1] += calls
        self.runq.update(self.row, self.calls.runq_ns)

    def _send_unit_frame(self, unit_id: int, k: int, items: list[Any], unit: Any) -> bool:
        """Commit frame ``k`` of a unit; False when an error was reported instead."""
        made = len(items)
        marks = self.calls.take_not_items()  # the unit's end mark is not an item
        depth = self.chain.depth
        if depth:
            where = f"work unit {short_repr(unit)}, frame {k}"
            chained = self.chain.run(unit_id, items, depth, where)
            if chained is None:
                return False
            items = chained
        out = self.emitter.encode_items(
            unit_id, items, lambda: f"work unit {short_repr(unit)}, frame {k}", depth
        )
        if out is None:
            return False
        payload, nbytes, items = out
        self.row[stats.ITEMS_IN] += made - marks
        self.row[stats.ITEMS_OUT] += (made if depth else len(items)) - marks
        self.row[stats.BYTES_OUT] += nbytes
        self.row[stats.FRAMES_OUT] += 1
        self.link.say(P.Emit(self.wid, unit_id, k, payload, len(items), depth))
        return True

    def run_frame(self, frame_id: int, payload: Any, skip: frozenset[int]) -> None:
        t0, c0 = _ns(), _cpu_ns()
        items = arena.decode(payload, self.cache, self.link.release)
        self.row[stats.HOP_NS] += _cpu_ns() - c0
        self.row[stats.FRAMES_IN] += 1
        self.row[stats.ITEMS_IN] += len(items)
        st = self.stage
        cell = self.cell
        cell[stats.WORK_ID] = frame_id + 1
        cell[stats.IN_FN_SINCE_NS] = _mono_ns()
        try:
            if st.kind == "stateful":
                self._run_stateful(frame_id, items, skip)
                return
            out = self._call(frame_id, items)
            if out is None:
                return
            del items
            made = len(out)
            marks = self.calls.take_not_items()
            self.row[stats.ITEMS_IN] -= marks
            depth = self.chain.depth
            if depth:
                out = self.chain.run(frame_id, out, depth, f"frame {frame_id}")
                if out is None:
                    return
            encoded = self.emitter.encode_items(frame_id, out, lambda: f"frame {frame_id}", depth)
            if encoded is None:
                return
            payload_out, nbytes, out = encoded
            # Counted once sent (a frame waiting for room is not out yet); what the stage
            # made, or, unfused, what pickled of it.
            self.row[stats.ITEMS_OUT] += (made if depth else len(out)) - marks
            self.row[stats.BYTES_OUT] += nbytes
            self.row[stats.FRAMES_OUT] += 1
            outs = [(payload_out, len(out))]
            self.link.say(P.Done(self.wid, frame_id, outs, None, self.link.take_frees(), depth))
        finally:
            cell[stats.IN_FN_SINCE_NS] = 0
            cell[stats.WORK_ID] = cell[stats.WORK_ITEM] = 0
            self._add_own_time(t0, c0)

    def _call(self, frame_id: int, items: list[Any]) -> list[Any] | None:
        """A stateless stage's function over a frame's items: side by side on the worker's
        threads when it runs calls in flight, else one call at a time (:func:`call_stage`);
        None when an error stops the stage."""
        st, cell = self.stage, self.cell
        if self.calls.width > 1 and len(items) > 1 and st.kind != "batch_map":
            # Calls that wait run side by side on the worker's threads, in order.
            out: list[Any] = []
            flat = st.kind == "flat_map"
            cell[stats.WORK_ITEM] = 1
            for i, o in enumerate(self.calls.map(st.fn, items)):
                if o.error is not None:
                    if not self._error(frame_id, o.error, f"item {i} of frame {frame_id}"):
                        return None
                elif flat:
                    out.extend(o.value)
                else:
                    out.append(o.value)
            return out
        n = len(items)
        return call_stage(
            st,
            items,
            lambda i, e: self._error(
                frame_id, e,
                f"frame of {n} items" if i is None else f"item {i} of frame {frame_id}",
            ),
            cell,
        )  # fmt: skip

    def _run_stateful(self, frame_id: int, items: list[Any], skip: frozenset[int]) -> None:
        if self.reducer is None:
            self.reducer = self.stage.fn(self.epoch, self.index)
        ready: list[Any] = []
        consumed: dict[Any, list[int]] = {}
        for i, x in enumerate(items):
            if i in skip:
                continue
            self.cell[stats.WORK_ITEM] = i + 1
            try:
                ready.extend(self.reducer.push((frame_id, i), x))
            except Exception as e:
                if not self._error(frame_id, e, f"item {i} of frame {frame_id}"):
                    return
                consumed.setdefault(frame_id, []).append(i)
        del items
        marks = self.calls.take_not_items()  # passed through at once: in and out now
        self.row[stats.ITEMS_IN] -= marks
        self.row[stats.ITEMS_OUT] -= marks
        self._commit_stateful(P.Done, frame_id, ready, consumed)

    def _commit_stateful(
        self, kind: type, frame_id: int | None, ready: list[Any], consumed: dict[Any, list[int]]
    ) -> None:
        """Emit a reducer's outputs with the inputs they consumed (``kind``: ``P.Done`` or
        ``P.Flushed``)."""
        outs_items = []
        for tags, out in ready:
            if out is not reducers.DROPPED:
                outs_items.append(out)
            for fid, i in tags:
                consumed.setdefault(fid, []).append(i)
        outs = self.emitter.emit_frames(outs_items, self.stage.frame_items) if outs_items else []
        del ready, outs_items
        if outs is None:
            return
        self.link.say(kind(self.wid, frame_id, outs, consumed, self.link.take_frees()))

    def flush(self) -> None:
        t0 = _ns()
        ready: list[Any] = self.reducer.flush() if self.reducer is not None else []
        self._commit_stateful(P.Flushed, None, ready, {})
        self.row[stats.BUSY_NS] += _ns() - t0

    def handoff(self) -> None:
        """Give the items held in state back to the stage (this worker retires)."""
        held: list[Any] = self.reducer.drain() if self.reducer is not None else []
        consumed: dict[Any, list[int]] = {}
        items = []
        for (fid, i), x in held:
            items.append(x)
            consumed.setdefault(fid, []).append(i)
        # Handed-over items are not outputs; undo their input count, the taker counts them.
        outs = (
            self.emitter.emit_frames(items, max(len(items), 1), count=False, hand_over=False)
            if items
            else []
        )
        if outs is None:
            return
        self.row[stats.ITEMS_IN] -= len(items)
        self.link.say(P.Handoff(self.wid, None, outs, consumed, self.link.take_frees()))

    # -- main loop --------------------------------------------------------------------------
    def loop(self) -> None:
        if not self.thread_worker:
            import torch

            torch.set_num_threads(self.stage.torch_threads)
        else:
            intraop.set_here(self.stage.torch_threads)  # its own, not the consumer's
        if self.stage.init is not None:
            self.stage.init(self.stage.name, self.index)
        self.runq = stats.RunQueue()
        concurrency._install(self.calls)  # sources reach it through concurrency.current()
        self.started = True
        self.link.say(P.Hello(self.wid, os.getpid()))
        while True:
            msg = self.link.next()
            if self._handle_control(msg):
                continue
            match msg:
                case P.Run(frame_id, payload, skip):
                    self.run_frame(frame_id, payload, skip)
                case P.Unit(unit_id, unit, skip_frames):
                    if self.readahead.units_at_once(self.stage.fn, unit) > 1:
                        self.readahead.run_units(self.stage.fn, unit_id, unit, skip_frames)
                    else:
                        self.run_unit(unit_id, unit, skip_frames)
                case P.Flush():
                    self.flush()
                case P.Retire():
                    if self.stage.kind == "stateful":
                        self.handoff()
                    self.link.say(P.Bye(self.wid, self.link.take_frees()))
                    return
                case _:
                    raise RuntimeError(f"worker got a message it does not take: {msg!r}")

    def close(self) -> None:
        # A stage function that holds something per worker (a remote actor) lets it go when
        # the worker ends: retired, replaced or stopped (StageSpec: on_worker_exit). A
        # function shared with the executor's process is no worker's to let go of.
        own = [self.stage] if self.owns_stage else []
        for st in own + self.chain.owned():
            hook = getattr(st.fn, "on_worker_exit", None)
            if callable(hook):
                try:
                    hook()
                except Exception:
                    log.exception("stage %r: the function's on_worker_exit failed", st.name)
        concurrency._install(None)
        # A thread worker's threads end before it does (a process worker's end with it).
        wait_s = THREADS_JOIN_S if self.thread_worker else 0.0
        self.readahead.close(wait_s)
        self.calls.close(wait_s)
        self.runq.close()
        self.cache.clear()
        self.counters.close(unlink=False)


def _trim_heap() -> None:
    """Return freed heap memory to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker_main(conn: Connection, *args: Any, is_thread: bool = False, owner_pid: int = 0) -> None:
    """Entry point of a worker (process target or thread target); a process worker ends
    when the executor's process ``owner_pid`` does, however that one ends."""
    if not is_thread:
        # Ctrl-C goes to the whole process group; the consumer decides what happens, and the
        # executor stops workers. A worker dying of SIGINT would look like a crash.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it
        if owner_pid:
            lifetime.die_with_owner(owner_pid)
        serialize.collate_into_private_memory()
    w = None
    wid = args[1] if len(args) > 1 else -1
    _here.thread_worker = is_thread
    try:
        w = _Worker(conn, *args)
        if not is_thread:
            # glibc keeps freed blocks (up to 32 MiB each: the unpickling's own buffers) for
            # reuse a worker never makes.
            _trim_heap()
        w.thread_worker = is_thread
        if is_thread:
            # torch's collate would stack each batch into a shared-memory segment of its own
            # where get_worker_info() is set, as it is on a thread worker (a process worker
            # replaced that entry for good above).
            with serialize.private_collate():
                w.loop()
        else:
            w.loop()
    except (_Exit, EOFError, BrokenPipeError, ConnectionResetError):
        pass
    except BaseException as e:  # report anything else (e.g. init failed) before dying
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            where = "worker start" if w is None or not w.started else "the worker's loop"
            msg = P.Error(wid, None, exc_payload(e), type(e).__name__, str(e), tb, where)
            conn.send(P.wire(msg))
        except Exception:
            # Nobody to tell: the executor is gone. Where it closed before this worker found
            # its segments (the interpreter's exit while workers start), nothing went wrong.
            if not (w is None and isinstance(e, FileNotFoundError)):
                print(tb, file=sys.stderr)
    finally:
        if w is not None:
            w.close()
        try:
            conn.close()
        except Exception:
            pass
