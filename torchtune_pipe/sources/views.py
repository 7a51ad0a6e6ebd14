"""A dataset of its own for every reader of the consumer's process that stands in for a worker.

A worker process reads its own copy of the dataset, forked from the consumer's process at
``iter()``: what a read sets on the dataset (a file opened on first use, as torch's docs advise
for handles that do not survive a fork; a cache; a counter) stays in that worker. Reads of the
consumer's process that stand in for workers (a fast start's inline reads, a kind probe's
threads, thread workers) would set it on the caller's own object: threads would share one file
and its offset at once, and the next epoch's workers would fork with it open, every one of them
seeking and reading through the same offset (records read at each other's positions).

So each such reader reads its own view (:class:`Views`): the dataset copied, and every dataset
it holds (a ``Subset``'s, a ``ConcatDataset``'s) copied too, their other attributes (tensors,
arrays, lists, dicts) shared, not copied; a dataset that is no ``torch.utils.data.Dataset`` (a
list, an array) is read as it is. A view is made at a reader's first read of a
generation, from a copy made at its start; a source starts a new generation with every snapshot
its workers fork from, so what the caller changed between epochs reaches the views as it reaches
new workers, and a persistent loader's thread workers keep the first epoch's, as its worker
processes do. Calls that a worker process runs side by side on threads read views too. A
dataset that cannot be copied is read as it is. A random generator a dataset holds is copied
(:func:`~torchtune_pipe.sources.rng.is_generator`): a view draws from its own, as a worker
does, and never from the caller's (the next epoch's workers fork with it as the caller left it).

Copying never reads the dataset's ``__dict__`` where it can help it: CPython (3.11, 3.12) keeps an
object's attributes inline until its ``__dict__`` is read, and from then on in a dict whose loads
are slower, for that object and every fork of it (a pure-Python ``__getitem__`` reading
``self.vocab`` per word runs 10-15% slower). :func:`_state` names the attributes from the code
of the dataset's class instead and checks them against what the object holds.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import logging
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

from multiproc.worker import in_thread_worker
from torchtune_pipe.sources.rng import copied_generator, generator_digest, is_generator

log = logging.getLogger(__name__)

# Datasets held by a dataset, copied this deep (a Subset of a ConcatDataset of datasets: 3).
_DEPTH = 4
# Plain objects a dataset holds (an augmentation's class), searched this deep for generators.
_HOLDER_DEPTH = 2

_here = threading.local()


@contextlib.contextmanager
def standing_in() -> Iterator[None]:
    """Within it, the calling thread's reads stand in for a worker's (:class:`Views`)."""
    before = getattr(_here, "on", False)
    _here.on = True
    try:
        yield
    finally:
        _here.on = before


def stands_in() -> bool:
    """Whether the calling thread reads for a worker in the consumer's process: within
    :func:`standing_in`, or a thread worker (:func:`multiproc.worker.in_thread_worker`)."""
    return getattr(_here, "on", False) or in_thread_worker()


class Views:
    """The views of one dataset: per thread that :func:`stands_in` for a worker, a copy of the
    generation's template, itself a copy of the dataset made before any read of the
    generation (so a view never holds what a read set on the dataset, e.g. a file it opened).

    A process's first read makes the template where the generation has none (once a
    snapshot was taken, or a reader stands in): a worker
    process's reading thread reads the dataset itself, as torch's worker does, while the
    threads its calls run on side by side read views. Pickled, only the dataset and the
    generation travel."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.generation = 0
        self._template: Any = None
        self._here = threading.local()
        self._held: dict[int, tuple[Any, list[tuple[Any, bytes]]]] = {}

    def renew(self) -> None:
        """Start a new generation, its template copied from the dataset as it is now."""
        self.generation += 1
        self._template = _copied(self.dataset, _DEPTH)
        self._held = {}

    def held(self, ds: Any) -> list[tuple[Any, bytes]]:
        """The random generators ``ds`` (the dataset, or a view of it) holds, each with the
        digest of its state when first asked for (:func:`~.rng.generator_digest`): a worker's
        copy or a view asks before its first read, so this is their state at ``iter()``."""
        got = self._held.get(id(ds))
        if got is None or got[0] is not ds:
            held = []
            for g in _generators(ds, _DEPTH):
                try:
                    held.append((g, generator_digest(g)))
                except Exception as e:  # a state that will not pickle: left as it goes on
                    log.debug("views: a %s is not seeded (%r)", type(g).__name__, e)
            got = (ds, held)
            self._held[id(ds)] = got
        return got[1]

    def get(self) -> Any:
        """The dataset a read of the calling thread uses: the dataset, or the thread's view."""
        standing = stands_in()
        # No template where no worker was ever snapshotted and no reader stands in
        # (num_workers=0): copying reads the dataset's __dict__, which slows its attributes.
        if self._template is None and (standing or self.generation):
            self._template = _copied(self.dataset, _DEPTH)
        if not standing:
            return self.dataset
        here = self._here
        if getattr(here, "generation", None) != self.generation:
            here.view, here.generation = _copied(self._template, _DEPTH), self.generation
        return here.view

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "generation": self.generation}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["dataset"])  # type: ignore[misc]
        self.generation = state["generation"]


def get_in_view(views: Views, i: Any) -> Any:
    """``dataset[i]``, read in the calling thread's own view (a call run on a thread of its
    own, beside others)."""
    with standing_in():
        return views.get()[i]


def _copied(obj: Any, depth: int) -> Any:
    """``obj`` copied (shallow), with the datasets among its attributes (alone, or as the items
    of a list or tuple) copied the same way, ``depth`` levels down; ``obj`` itself where it is
    no ``torch.utils.data.Dataset`` (a list, an array, a tensor: copied, they would be copied
    whole) or cannot be copied."""
    from torch.utils.data import Dataset

    if not isinstance(obj, Dataset):
        return obj
    held = _state(obj)
    fresh = held is not None
    if held is not None:
        out, state = object.__new__(type(obj)), held
    else:
        try:
            out = copy.copy(obj)
        except Exception as e:  # e.g. a __reduce__ that refuses: read it as it is
            log.debug("views: %s is read as it is (copying it raised %r)", type(obj).__name__, e)
            return obj
        attrs = getattr(out, "__dict__", None)
        if out is obj or not isinstance(attrs, dict):
            return out
        state = attrs
    for name, value in list(state.items()):
        state[name] = _with_own_generators(value, _HOLDER_DEPTH)
    if depth > 1:
        for name, value in list(state.items()):
            if isinstance(value, Dataset):
                state[name] = _copied(value, depth - 1)
            elif (
                type(value) in (list, tuple)
                and value
                and all(isinstance(v, Dataset) for v in value)
            ):
                state[name] = type(value)(_copied(v, depth - 1) for v in value)
    if fresh:
        for name, value in state.items():  # into the new object's inline attributes or slots
            object.__setattr__(out, name, value)
    return out


def _holder_state(obj: Any) -> dict[str, Any] | None:
    """The attributes of ``obj``, an object a dataset holds that may hold a generator of its
    own (an augmentation's class): those of a plain object that is no dataset (:func:`_state`),
    else None (a builtin, an array, a tensor, a class that copies itself its own way)."""
    from torch.utils.data import Dataset

    if isinstance(obj, (Dataset, type)) or is_generator(obj):
        return None
    return _state(obj)


def _with_own_generators(value: Any, depth: int) -> Any:
    """``value`` (an attribute of a dataset) as a view holds it: a generator copied; a plain
    object holding one, ``depth`` levels down, copied (shallow) with its generators copied;
    anything else, or what will not copy, ``value`` itself (shared)."""
    if is_generator(value):
        try:
            return copied_generator(value)
        except Exception as e:  # a subclass that will not copy: shared
            log.debug("views: a %s is shared (copying it raised %r)", type(value).__name__, e)
            return value
    held = _holder_state(value) if depth > 0 else None
    if not held:
        return value
    own = {name: _with_own_generators(v, depth - 1) for name, v in held.items()}
    if all(own[name] is v for name, v in held.items()):
        return value
    out = object.__new__(type(value))
    for name, v in own.items():  # into the new object's inline attributes or slots
        object.__setattr__(out, name, v)
    return out


def _generators(obj: Any, depth: int) -> list[Any]:
    """The random generators held by ``obj``, by the datasets it holds (alone, or as the items
    of a list or tuple), ``depth`` levels down, and by the plain objects these hold,
    ``_HOLDER_DEPTH`` levels down (those :func:`_with_own_generators` copies), each once."""
    from torch.utils.data import Dataset

    out: list[Any] = []
    seen: set[int] = set()

    def held_by(o: Any, d: int) -> None:  # a plain object a dataset holds
        state = _holder_state(o) if d > 0 and id(o) not in seen else None
        seen.add(id(o))
        for value in (state or {}).values():
            if is_generator(value) and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
            else:
                held_by(value, d - 1)

    def walk(o: Any, d: int) -> None:
        if id(o) in seen or not isinstance(o, Dataset):
            return
        seen.add(id(o))
        state = _state(o)
        # Else what the object refers to, read without materializing its __dict__ (where it
        # already is one, its values).
        values = list(state.values()) if state is not None else _referred(o)
        for value in values:
            if is_generator(value) and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
            elif d > 1 and isinstance(value, Dataset):
                walk(value, d - 1)
            elif d > 1 and type(value) in (list, tuple) and value and isinstance(value[0], Dataset):
                for v in value:
                    walk(v, d - 1)
            elif not isinstance(value, Dataset):
                held_by(value, _HOLDER_DEPTH)

    walk(obj, depth)
    return out


def _referred(obj: Any) -> list[Any]:
    out: list[Any] = []
    for r in gc.get_referents(obj):
        out.extend(r.values() if type(r) is dict else [r])
    return out


_MISSING = object()


def _state(obj: Any) -> dict[str, Any] | None:
    """The attributes ``obj`` holds (instance attributes and slots), read without its
    ``__dict__``: the names are those the code of its class stores or loads
    (:func:`_names`), and they must account for every value the object holds, as the garbage
    collector sees them (``gc.get_referents``); ``None`` where they do not (an attribute set
    from outside the class, a dict already materialized) or where the class copies itself its
    own way (``__copy__``, ``__reduce__``, ``__getstate__``, ``__setstate__``, ``__new__``)."""
    cls = type(obj)
    if not _plain(cls):
        return None
    held = collections.Counter(id(r) for r in gc.get_referents(obj))
    if held[id(cls)] > 0:  # a heap type's instance refers to its type
        held[id(cls)] -= 1
    state: dict[str, Any] = {}
    defaults: list[tuple[str, Any]] = []  # class attributes the object may hold too
    for name in _names(cls):
        static = _MISSING
        for k in cls.__mro__:
            if name in vars(k):
                static = vars(k)[name]
                break
        if isinstance(static, types.MemberDescriptorType):  # a slot
            try:
                state[name] = static.__get__(obj, cls)
            except AttributeError:
                pass
            continue
        if static is not _MISSING and hasattr(type(static), "__get__"):
            continue  # a method, property, ...: the object holding one of these names is seen below
        try:
            value = object.__getattribute__(obj, name)
        except AttributeError:
            continue
        if static is not _MISSING and value is static:
            defaults.append((name, value))
        else:
            state[name] = value
    for value in state.values():
        held[id(value)] -= 1
        if held[id(value)] < 0:
            return None
    for name, value in defaults:  # the class's value, also held by the object
        if held[id(value)] > 0:
            held[id(value)] -= 1
            state[name] = value
    return None if +held else state


def _plain(cls: type) -> bool:
    return (
        cls.__new__ is object.__new__
        and cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None)
        and getattr(cls, "__copy__", None) is None
        and getattr(cls, "__setstate__", None) is None
    )


_names_of: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _names(cls: type) -> frozenset[str]:
    """The names the code of ``cls`` and its bases can store on an instance: the names its
    functions (methods, properties, nested functions) load and store, the identifiers among
    their string constants (``setattr(self, "x", ...)``), and its slots."""
    known = _names_of.get(cls)
    if known is not None:
        return known
    names: set[str] = set()

    def walk(code: types.CodeType) -> None:
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, str) and c.isidentifier():
                names.add(c)
            elif isinstance(c, types.CodeType):
                walk(c)

    for k in cls.__mro__[:-1]:
        for value in vars(k).values():
            if isinstance(value, functools.cached_property):
                names.add(value.attrname or "")
            for f in (
                value,
                getattr(value, "__func__", None),
                getattr(value, "func", None),
                getattr(value, "fget", None),
                getattr(value, "fset", None),
            ):
                code = getattr(f, "__code__", None)
                if isinstance(code, types.CodeType):
                    walk(code)
        slots = vars(k).get("__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot.startswith("__") and not slot.endswith("__"):
                slot = f"_{k.__name__.lstrip('_')}{slot}"
            names.add(slot)
    names -= {"", "__dict__", "__weakref__"}
    known = _names_of[cls] = frozenset(names)
    return known


__all__ = ["Views", "get_in_view", "stands_in", "standing_in"]
