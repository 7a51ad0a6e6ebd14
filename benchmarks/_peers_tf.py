"""The tf.data contenders of ``benchmarks/peers.py``, run by a Python that has TensorFlow.

``python benchmarks/_peers_tf.py SPEC.json`` (TensorFlow's own environment, see ``make
peers-tf-env``) reads the spec of ``benchmarks._peers_fns``, builds one of two tf.data
pipelines over the same Criteo files and 1 MiB work units, iterates it for ``duration_s``
seconds after its first batch and writes the arrival time and row count of every batch to
``spec["out"]`` (the same result format and ``.first`` marker as ``_peers_fns``). Every
parallel op and every prefetch uses ``tf.data.AUTOTUNE``, and maps are unordered
(``deterministic=False``), as the peers are.

``tfdata-ops``: the pipeline as a TensorFlow user writes it, in TensorFlow ops. Each work unit
(the lines that start in a byte range of a file, as in ``LineFileSource``) is read by a
``FixedLengthRecordDataset`` of one record, interleaved over units; the lines are split,
rebatched to ``batch_size`` rows, then parsed with ``tf.strings`` (missing counts -> 0, hex ids
-> ``1 + id % (size - 1)`` with row 0 for a missing id, ``log(1 + max(x, 0))`` of the counts,
as ``Features`` does). The remote-read latency is a ``tf.py_function`` sleep per unit, and the
``udf`` scenario's ``ExtraCost`` (a CPU cost defined in Python) is the real ``ExtraCost`` wrapped
in ``tf.py_function``: those two are the only Python in this variant. Its parser does not
reject malformed rows as ``parse_rows`` does.

``tfdata-pyfunc``: the peers' own per-unit work (``UnitWork``: the shared ``CriteoSource``
reader and parser, ``Features``, ``ExtraCost``) called through ``tf.py_function`` in a map with
AUTOTUNE parallelism, then rebatched and prefetched. Python runs under one GIL, so this is how
far tf.data takes Python UDFs on threads.

Both end with TF tensors ``(dense float32 [B, 13], sparse int64 [B, 26], labels float32 [B])``
and read the unit list epoch after epoch (``repeat``) through one iterator, so AUTOTUNE keeps
what it learnt across epochs. Nothing here imports TensorFlow at module level, so tests and
``peers.py`` import it from the main environment.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from benchmarks import _consume

TOOLS = ("tfdata-ops", "tfdata-pyfunc")
SPEC_FIELDS = (
    "tool", "paths", "chunk_rows", "chunk_bytes", "batch_size", "duration_s", "out",
    "table_sizes",
)  # fmt: skip
"""Fields of the spec this module requires; ``extra_cost_ns``, ``latency_s`` and ``step_s``
are optional (0 when absent)."""
NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_SCAN_BYTES = 1 << 16  # bytes read at a time while looking for the end of a line


def line_units(paths: Sequence[str], chunk_bytes: int) -> list[tuple[str, int, int]]:
    """The work units of ``LineFileSource`` as byte ranges that hold whole lines.

    A unit is the lines that start in ``[k * chunk_bytes, (k + 1) * chunk_bytes)`` of a file;
    its range runs from the first such line to the first line of the next unit (or the end of
    the file). Units with no line (a line longer than ``chunk_bytes``) are left out.

    Returns:
        ``(path, begin, end)`` per unit, files in the given order.

    Raises:
        ValueError: ``chunk_bytes`` is not positive, or a path is gzip-compressed.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"line_units(): chunk_bytes must be positive, got {chunk_bytes}")
    units = []
    for path in paths:
        if path.endswith(".gz"):
            raise ValueError(f"line_units(): {path} is gzip; byte-range units need plain files")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            cuts = [_line_start(f, b, size) for b in range(0, size, chunk_bytes)] + [size]
        units += [(path, a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return units


def _line_start(f: Any, offset: int, size: int) -> int:
    """The offset of the first line that starts at or after ``offset``."""
    if offset == 0:
        return 0
    pos = offset - 1  # a line starts at ``offset`` iff the byte before it is a newline
    while pos < size:
        f.seek(pos)
        block = f.read(_SCAN_BYTES)
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)
    return size


# ------------------------------------------------------------------------- the pipelines
def _ops(spec: dict, tf: Any) -> Any:
    """``tfdata-ops``: reading, parsing and features in TensorFlow ops."""
    parallel = dict(num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    units = line_units(spec["paths"], spec["chunk_bytes"])
    paths = [p for p, _, _ in units]
    # One record per unit: skip ``begin`` bytes (header), read the unit, ignore the rest.
    begins = [b for _, b, _ in units]
    lengths = [e - b for _, b, e in units]
    rests = [os.path.getsize(p) - e for p, _, e in units]
    columns = (paths, *(tf.constant(c, tf.int64) for c in (begins, lengths, rests)))
    ds = tf.data.Dataset.from_tensor_slices(columns).repeat()
    latency_s = float(spec.get("latency_s", 0.0))
    if latency_s > 0:

        def wait(header: Any) -> Any:
            time.sleep(latency_s)  # emulated first-byte latency of a remote read
            return header

        def remote(path: Any, header: Any, length: Any, footer: Any) -> tuple:
            header = tf.py_function(wait, [header], tf.int64)  # the read waits on it
            return path, tf.reshape(header, []), length, footer

        ds = ds.map(remote, **parallel)

    def read(path: Any, header: Any, length: Any, footer: Any) -> Any:
        unit = tf.data.FixedLengthRecordDataset(
            path, length, header_bytes=header, footer_bytes=footer
        )
        return unit.map(_split_lines(tf))

    ds = ds.interleave(read, **parallel)
    ds = ds.rebatch(spec["batch_size"])
    ds = ds.map(_parse_features(tf, spec["table_sizes"]), **parallel)
    if spec.get("extra_cost_ns", 0) > 0:
        ds = ds.map(_py_extra_cost(tf, spec["extra_cost_ns"]), **parallel)
    return ds.prefetch(tf.data.AUTOTUNE)


def _split_lines(tf: Any) -> Callable[[Any], Any]:
    def split(blob: Any) -> Any:
        lines = tf.strings.split(blob, "\n")
        lines = tf.strings.regex_replace(lines, "\r$", "")
        return tf.boolean_mask(lines, tf.strings.length(lines) > 0)

    return split


def _parse_features(tf: Any, table_sizes: Sequence[int]) -> Callable[[Any], tuple]:
    """Raw lines -> ``(log(1 + counts), table rows, labels)``, as ``parse_rows`` + ``Features``."""
    rows_per_table = tf.constant([s - 1 for s in table_sizes], tf.int64)
    powers = tf.constant([16**k for k in range(7, -1, -1)], tf.int64)

    def parse(lines: Any) -> tuple:
        # Rows may lack their trailing empty fields: pad every row to 40 with "".
        fields = tf.strings.split(lines, "\t").to_tensor("", shape=[None, NUM_FIELDS])
        labels = tf.strings.to_number(fields[:, 0], tf.float32)
        counts = fields[:, 1 : 1 + NUM_DENSE]
        counts = tf.strings.to_number(tf.where(counts == "", "0", counts), tf.int64)
        dense = tf.math.log1p(tf.cast(tf.maximum(counts, 0), tf.float32))
        hexes = fields[:, 1 + NUM_DENSE :]
        # Right-align each id in 8 characters of '0', then read the characters as nibbles.
        width = tf.strings.length(hexes)
        padded = tf.strings.substr("00000000" + hexes, width, tf.fill(tf.shape(width), 8))
        chars = tf.cast(tf.io.decode_raw(padded, tf.uint8), tf.int64)
        nibbles = tf.where(chars <= ord("9"), chars - ord("0"), (chars | 32) - ord("a") + 10)
        ids = tf.reduce_sum(nibbles * powers, axis=-1)
        sparse = tf.where(hexes == "", tf.constant(0, tf.int64), 1 + ids % rows_per_table)
        return dense, sparse, labels

    return parse


def _py_extra_cost(tf: Any, ns_per_row: int) -> Callable[..., tuple]:
    """``ExtraCost`` (the real one, from ``examples/dlrm``) on each batch via ``tf.py_function``."""
    from examples.dlrm.criteo import CriteoChunk, ExtraCost

    extra = ExtraCost(ns_per_row)

    def burn(dense: Any, sparse: Any, labels: Any) -> list:
        extra(CriteoChunk(labels.numpy(), dense.numpy(), sparse.numpy()))
        return [dense, sparse, labels]

    def apply(dense: Any, sparse: Any, labels: Any) -> tuple:
        out = tf.py_function(burn, [dense, sparse, labels], [tf.float32, tf.int64, tf.float32])
        return _shaped(out)

    return apply


def _shaped(out: Sequence[Any]) -> tuple:
    """Restores the static shapes that ``tf.py_function`` drops (``rebatch`` needs the rank)."""
    dense, sparse, labels = out
    dense.set_shape([None, NUM_DENSE])
    sparse.set_shape([None, NUM_SPARSE])
    labels.set_shape([None])
    return dense, sparse, labels


def _pyfunc(spec: dict, tf: Any) -> Any:
    """``tfdata-pyfunc``: the peers' ``UnitWork`` per unit through ``tf.py_function``."""
    import numpy as np

    from benchmarks._peers_fns import make_work
    from examples.dlrm.criteo import CriteoChunk

    work = make_work(spec)
    units = work.source.units(0)

    def run_unit(index: Any) -> list:
        chunk = CriteoChunk.concat(work(units[int(index)]))
        return [chunk.dense, chunk.sparse, chunk.labels.astype(np.float32)]

    def apply(index: Any) -> tuple:
        out = tf.py_function(run_unit, [index], [tf.float32, tf.int64, tf.float32])
        return _shaped(out)

    ds = tf.data.Dataset.range(len(units)).repeat()
    ds = ds.map(apply, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    return ds.rebatch(spec["batch_size"]).prefetch(tf.data.AUTOTUNE)


def check_spec(spec: dict) -> None:
    """Raises ValueError naming what is wrong with ``spec``: a missing field, an unknown tool."""
    missing = [k for k in SPEC_FIELDS if k not in spec]
    if missing:
        raise ValueError(f"benchmarks/_peers_tf.py: the spec lacks {missing}")
    if spec["tool"] not in TOOLS:
        raise ValueError(
            f"benchmarks/_peers_tf.py: unknown tool {spec['tool']!r}; choose one of {TOOLS}"
        )


def build(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None]]:
    """``(epoch -> iterator of batches, stop)`` for ``spec["tool"]`` (one endless iterator).

    Raises:
        ValueError: an unknown tool, or a spec field this module needs is missing.
    """
    check_spec(spec)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow's first import
    import tensorflow as tf

    ds = _ops(spec, tf) if spec["tool"] == "tfdata-ops" else _pyfunc(spec, tf)
    it = iter(ds)
    return (lambda epoch: it), lambda: None


def warm_imports(spec: dict) -> None:
    """Imports TensorFlow (seconds) and the Python UDFs' modules before the clock starts, as
    ``_peers_fns.warm_imports`` does for the peers, so ``startup_s`` times the pipeline alone."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow's first import
    import tensorflow  # noqa: F401

    if spec.get("tool") == "tfdata-pyfunc":
        import benchmarks._peers_fns  # noqa: F401
    elif spec.get("extra_cost_ns", 0) > 0:
        import examples.dlrm.criteo  # noqa: F401


def batch_rows(batch: Any) -> int:
    """Rows of one ``(dense, sparse, labels)`` batch."""
    return int(batch[2].shape[0])


# ---------------------------------------------------------------------------- the run
def consume(
    spec: dict,
    build: Callable[[dict], tuple[Callable[[int], Iterator[Any]], Callable[[], None]]] = build,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """``benchmarks._consume.consume`` with TF batches' row count."""
    return _consume.consume(spec, build, batch_rows, clock)


def write_result(path: str, result: dict) -> None:
    """Writes ``result`` as JSON to ``path`` atomically (a ``.tmp`` file, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """Entry point: ``python benchmarks/_peers_tf.py SPEC.json``."""
    if len(argv) != 1:
        print("usage: python benchmarks/_peers_tf.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        check_spec(spec)
        warm_imports(spec)
    except Exception:  # reported in the result, as consume reports a failed build
        result = {"times": [], "rows": [], "error": traceback.format_exc(limit=4), "stop": None}
    else:
        result = consume(spec)
    stop = result.pop("stop")
    write_result(spec["out"], result)  # before shutdown, as in _peers_fns
    if stop is not None:
        stop()
    return 0 if result["error"] is None else 3


if __name__ == "__main__":
    # Run as a script by another interpreter: make the repository importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))


__all__ = [
    "SPEC_FIELDS", "TOOLS", "batch_rows", "build", "check_spec", "consume", "line_units", "main",
    "warm_imports", "write_result",
]  # fmt: skip
