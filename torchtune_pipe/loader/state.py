"""Checking a saved loader state before it is trusted: its shape, types and ranges, and a
fingerprint of the pipeline and source that saved it.

A state is plain data that survives ``json.dumps``/``json.loads`` and ``torch.load(...,
weights_only=True)``: ints, bools, strings, lists and dicts (JSON turns the int keys of
``partial`` into strings, which :func:`check` turns back). Each field is checked and the
first bad one is named in a :class:`StateError`. Checks that need the epoch's units
(positions past a unit's end, units past the epoch's count) run when the epoch starts: see
:func:`torchtune_pipe.loader.progress.plan_epoch` and :func:`torchtune_pipe.sources.base.read_indexed`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from torchtune_pipe.errors import StateError

_WHERE = "Loader.load_state_dict()"
# The fingerprint's digest of the source's type and length and of the stateful stages: what a
# state whose fingerprint is a string (version-1 states written before the fields were named)
# is compared with.
DIGEST = "digest"


def type_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s type."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def source_fingerprint(source: Any) -> Any:
    """The fields of ``source`` a state must match, as a dict: the source's own
    ``fingerprint()`` where it offers one (a mapping of fields, or a string), else its type
    and length. (Typed ``Any``: ``sources.collated.Collated.fingerprint``, which passes it on, is
    annotated ``str``.)"""
    own = getattr(source, "fingerprint", None)
    if callable(own):
        fields = own()
        return dict(fields) if isinstance(fields, Mapping) else {"source": str(fields)}
    out: dict[str, Any] = {"source": type_name(source)}
    try:
        out["len(source)"] = len(source)
    except TypeError:
        pass
    return out


# What decides the order of torch's samplers besides the dataset's length, by class: the
# attributes a state must match. DistributedSampler's rank is left out: ranks iterate in
# step, so a state saved by rank 0 (the one checkpoint a trainer writes) resumes every rank.
# BatchSampler's batch_size and drop_last are fields of their own.
_SAMPLER_ARGS = {
    "SequentialSampler": (),
    "RandomSampler": ("replacement", "num_samples", "generator"),
    "SubsetRandomSampler": ("indices", "generator"),
    "WeightedRandomSampler": ("weights", "num_samples", "replacement", "generator"),
    "DistributedSampler": ("num_replicas", "shuffle", "seed", "drop_last"),
    "BatchSampler": (),
}


def sampler_fingerprint(sampler: Any) -> str | None:
    """A sampler's kind and what decides its order: the arguments of torch's samplers (a
    generator by whether one is given: the state replays its draws), the length of another
    (None: no sampler)."""
    if sampler is None:
        return None
    args = None
    for cls in type(sampler).__mro__:
        if cls.__module__.startswith("torch.utils.data") and cls.__name__ in _SAMPLER_ARGS:
            args = _SAMPLER_ARGS[cls.__name__]
            break
    name = type_name(sampler)
    if args is None:
        try:
            return f"{name}(len={len(sampler)})"
        except TypeError:
            return name
    return f"{name}({', '.join(f'{a}={_arg(getattr(sampler, a, None))}' for a in args)})"


def map_source_fingerprint(source: Any) -> dict[str, Any]:
    """What decides which samples an epoch of a
    :class:`~torchtune_pipe.sources.map_dataset.MapDatasetSource` yields, by field: the dataset's type
    and length, the sampler and batch sampler (kinds and arguments,
    :func:`sampler_fingerprint`), ``shuffle``, ``batch_size``, ``drop_last``, whether a
    ``generator`` is given, the entries per unit and the number of ranks, then the source's
    type and length.

    A generator's seed is left out: a state replays the draws of the epoch it was saved in
    (``units_state``), whatever seed the loading loader's generator was given.
    """
    from torch.utils.data import BatchSampler, RandomSampler

    bs = source.batch_sampler
    # The sampler that orders the samples: a BatchSampler's own; none under another kind of
    # batch sampler (it decides alone).
    order = source.sampler if bs is None else getattr(bs, "sampler", None)
    if bs is not None and not isinstance(bs, BatchSampler):
        order = None
    try:
        n: int | None = len(source.dataset)
    except TypeError:
        n = None
    fields: dict[str, Any] = {
        "dataset": type_name(source.dataset),
        "len(dataset)": n,
        "shuffle": isinstance(order, RandomSampler),
        "sampler": sampler_fingerprint(order),
        "batch_size": bs.batch_size if isinstance(bs, BatchSampler) else None,
        "drop_last": bs.drop_last if isinstance(bs, BatchSampler) else None,
        "batch_sampler": sampler_fingerprint(bs),
        "generator": source.generator is not None,
        "entries_per_unit": source.entries_per_unit,
        "world_size": source.world_size,
        "source": type_name(source),
    }
    try:
        fields["len(source)"] = len(source)
    except TypeError:
        pass
    return fields


def _arg(value: Any) -> str:
    """A sampler argument in a fingerprint: scalars as written, a generator as given or
    not, a sequence (indices, weights) by its length and a digest of its values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if hasattr(value, "get_state") and hasattr(value, "manual_seed"):
        return "given"  # a torch.Generator
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    digest = hashlib.sha256(repr(values).encode()).hexdigest()[:12]
    return f"<{len(values)} values, sha256 {digest}>"


def fingerprint(pipeline: Any) -> dict[str, Any]:
    """What must match between the loader that saved a state and the one loading it, by
    field: the source's (:func:`source_fingerprint`; a map-style dataset's length, type,
    samplers, batching and generator) and the stages that hold items (shuffle buffers and
    seeds, batch sizes). Map stages, worker counts and buffer budgets are left out: they do
    not change which item a position names, so a state loads under any allocation. Plain
    data (JSON-safe); its :data:`DIGEST` is what states saved before fields were named
    compare with."""
    fields: dict[str, Any] = source_fingerprint(pipeline.source)
    legacy = [_legacy_source(fields)]
    for st in pipeline.stages:
        if st.stateful:
            fields[f"stage {st.name!r}"] = (
                f"{st.kind}(size={st.size}, drop_last={st.drop_last}, buffer={st.buffer}, "
                f"seed={st.seed})"
            )
            legacy.append(f"{st.kind}:{st.size}:{st.drop_last}:{st.buffer}:{st.seed}")
    fields[DIGEST] = hashlib.sha256("|".join(legacy).encode()).hexdigest()[:16]
    return fields


def _legacy_source(fields: Mapping[str, Any]) -> str:
    """The source's part of :data:`DIGEST`: its type, and its length where it has one."""
    source = str(fields.get("source"))
    return f"{source}:len={fields['len(source)']}" if "len(source)" in fields else source


def _check_fingerprint(saved: Any, expected: Mapping[str, Any]) -> None:
    if isinstance(saved, str):  # saved before the fingerprint named its fields
        if saved != expected.get(DIGEST):
            raise StateError(
                f"{_WHERE}: state['fingerprint'] is {saved!r}, this loader's is "
                f"{expected.get(DIGEST)!r}: the state was saved by another pipeline or source "
                "(stages, batch sizes, shuffle seeds or the source's type or length differ)"
            )
        return
    if not isinstance(saved, Mapping):
        raise StateError(
            f"{_WHERE}: state['fingerprint'] must map fields to values, got {type(saved).__name__}"
        )
    keys = [k for k in (*expected, *(k for k in saved if k not in expected)) if k != DIGEST]
    differ = [k for k in keys if saved.get(k) != expected.get(k)]
    if not differ and saved.get(DIGEST, expected.get(DIGEST)) != expected.get(DIGEST):
        differ = [DIGEST]
    if differ:
        what = "; ".join(
            f"{k}: saved {saved.get(k)!r}, this loader's {expected.get(k)!r}" for k in differ
        )
        raise StateError(
            f"{_WHERE}: the state was saved by another pipeline or source, which this loader "
            f"cannot resume: state['fingerprint'] differs in {what}"
        )


def _int(value: Any, field: str, low: int) -> int:
    """``field`` as it reads after ``state``: ``['epoch']``, ``['partial'][3]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StateError(f"{_WHERE}: state{field} must hold ints >= {low}, got {value!r}")
    return value


def _positions(value: Any, field: str) -> list[int]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise StateError(
            f"{_WHERE}: state{field} must be a list of positions, got {type(value).__name__}"
        )
    out = [_int(v, field, 0) for v in value]
    if len(set(out)) != len(out):
        raise StateError(f"{_WHERE}: state{field} lists a position twice")
    return out


def check(state: Any, version: int, expected_fingerprint: Mapping[str, Any]) -> dict:
    """A validated copy of ``state`` (keys of ``partial`` as ints).

    Raises:
        StateError: naming the first field that is missing, of the wrong type or out of
            range, or a fingerprint of another pipeline or source (naming the fields that
            differ).
    """
    if not isinstance(state, Mapping) or state.get("version") != version:
        raise StateError(
            f"{_WHERE}: expected a state of version {version} from Loader.state_dict(), got "
            f"{type(state).__name__}"
            + (f" of version {state.get('version')!r}" if isinstance(state, Mapping) else "")
        )
    missing = {"epoch", "finished", "done", "partial", "delivered", "last_unit"} - set(state)
    if missing:
        raise StateError(f"{_WHERE}: state lacks {sorted(missing)}")
    saved = state.get("fingerprint")
    if saved is not None:
        _check_fingerprint(saved, expected_fingerprint)
    out = dict(state)
    _int(state["epoch"], "['epoch']", 0)
    if not isinstance(state["finished"], bool):
        raise StateError(f"{_WHERE}: state['finished'] must be a bool, got {state['finished']!r}")
    done = _positions(state["done"], "['done']")
    _int(state["delivered"], "['delivered']", 0)
    _int(state["last_unit"], "['last_unit']", -1)
    if not isinstance(state["partial"], Mapping):
        raise StateError(
            f"{_WHERE}: state['partial'] must map units to positions, got "
            f"{type(state['partial']).__name__}"
        )
    partial = {}
    for u, ks in state["partial"].items():
        try:
            unit = int(u)  # JSON turns the int keys into strings
        except (TypeError, ValueError):
            raise StateError(
                f"{_WHERE}: state['partial'] has a key {u!r} that is no unit"
            ) from None
        field = f"['partial'][{unit}]"
        _int(unit, "['partial'] keys", 0)
        if unit in done:
            raise StateError(f"{_WHERE}: unit {unit} is both in state['done'] and state['partial']")
        partial[unit] = _positions(ks, field)
    out["partial"] = partial
    return out
