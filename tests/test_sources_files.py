"""LineFileSource: byte-range units, gzip, globs, sharding, errors, skipping, pickling."""

from __future__ import annotations

import gzip
import logging
import pickle
import random

import pytest

from torchtune_pipe.errors import BadLinesError, SourceError, TorchtunePipeError
from torchtune_pipe.sources import linefiles as linefiles_module
from torchtune_pipe.sources.base import FileRange, LineFileSource, SkippedLine, UnitStats


def read_all(source: LineFileSource, epoch: int = 0) -> list:
    """Every item of every unit, flattening batches."""
    out = []
    for unit in source.units(epoch):
        for item in source.read(unit):
            out.extend(item if isinstance(item, list) else [item])
    return out


def read_with_stats(source: LineFileSource, unit: FileRange) -> tuple[list, UnitStats]:
    items = []

    def consume():
        stats = yield from source.read(unit)
        return stats

    gen = consume()
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            return items, stop.value


def write(path, text: str) -> str:
    path.write_bytes(text.encode())
    return str(path)


@pytest.mark.parametrize("trial", range(6))
def test_byte_ranges_cover_every_line_exactly_once(tmp_path, trial):
    rng = random.Random(trial)
    for case in range(40):
        n = rng.randint(0, 60)
        lines = [
            "" if rng.random() < 0.15 else f"{i}:" + "x" * rng.randint(0, 20) for i in range(n)
        ]
        newline = rng.choice(["\n", "\r\n"])
        text = newline.join(lines) + (newline if lines and rng.random() < 0.5 else "")
        path = write(tmp_path / f"f{case}.txt", text)
        expected = text.split(newline)
        if text.endswith(newline) or text == "":
            expected = expected[:-1]
        source = LineFileSource(
            path,
            chunk_bytes=rng.randint(1, 64),
            read_block_bytes=rng.randint(1, 48),
            batch_lines=rng.choice([None, 1, 4]),
        )
        assert read_all(source) == expected, (trial, case, text)


def test_units_are_ordered_ranges_with_stable_ids(tmp_path):
    path = write(tmp_path / "a.txt", "".join(f"line {i}\n" for i in range(100)))
    units = LineFileSource(path, chunk_bytes=100).units()
    assert [u.id for u in units] == list(range(len(units)))
    assert units[0].start == 0 and units[0].first_line == 1
    assert all(u.first_line is None for u in units[1:])
    assert all(a.end == b.start for a, b in zip(units[:-1], units[1:], strict=True))
    assert units[-1].end == (tmp_path / "a.txt").stat().st_size


def test_gzip_file_is_one_unit(tmp_path):
    lines = [f"row {i}" for i in range(1000)]
    path = tmp_path / "d.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines))  # no final newline
    source = LineFileSource(str(path), chunk_bytes=16, batch_lines=64)
    units = source.units()
    assert len(units) == 1 and units[0].compressed
    items, stats = read_with_stats(source, units[0])
    assert [line for batch in items for line in batch] == lines
    assert stats == UnitStats(0, 1000, 0, len("\n".join(lines)))


def test_glob_patterns_expand_sorted_and_empty_files_have_no_units(tmp_path):
    for name in ["b.txt", "a.txt", "c.log"]:
        write(tmp_path / name, f"{name}\n")
    write(tmp_path / "empty.txt", "")
    source = LineFileSource([str(tmp_path / "*.txt"), str(tmp_path / "c.log")])
    assert [p.rsplit("/", 1)[1] for p in source.paths] == ["a.txt", "b.txt", "empty.txt", "c.log"]
    assert read_all(source) == ["a.txt", "b.txt", "c.log"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        LineFileSource(str(tmp_path / "*.csv"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        LineFileSource(str(tmp_path / "missing.txt"))


def test_sharding_by_rank_splits_units_without_overlap(tmp_path):
    for k in range(3):
        write(tmp_path / f"part{k}.txt", "".join(f"{k}-{i}\n" for i in range(50)))
    pattern = str(tmp_path / "part*.txt")
    everything = read_all(LineFileSource(pattern, chunk_bytes=64))
    all_units = LineFileSource(pattern, chunk_bytes=64).units()
    per_rank = []
    for rank in range(3):
        source = LineFileSource(pattern, chunk_bytes=64, rank=rank, world_size=3)
        assert source.units() == all_units[rank::3]
        per_rank.append(read_all(source))
    assert sorted(sum(per_rank, [])) == sorted(everything)
    assert len(sum(per_rank, [])) == len(everything) == 150


def test_shuffled_units_depend_on_epoch_and_agree_across_ranks(tmp_path):
    path = write(tmp_path / "a.txt", "".join(f"{i}\n" for i in range(300)))
    make = LineFileSource
    full = [u.id for u in make(path, chunk_bytes=20, shuffle_units=True, seed=3).units(epoch=1)]
    assert full == [u.id for u in make(path, chunk_bytes=20, shuffle_units=True, seed=3).units(1)]
    assert full != [u.id for u in make(path, chunk_bytes=20, shuffle_units=True, seed=3).units(2)]
    assert sorted(full) == list(range(len(full)))
    rank1 = make(path, chunk_bytes=20, shuffle_units=True, seed=3, rank=1, world_size=2)
    assert [u.id for u in rank1.units(epoch=1)] == full[1::2]


def test_parse_error_names_file_and_line(tmp_path):
    lines = [str(i) for i in range(500)]
    lines[357] = "not-a-number"
    path = write(tmp_path / "ints.txt", "\n".join(lines) + "\n")
    source = LineFileSource(path, parse=int, chunk_bytes=97)
    with pytest.raises(SourceError) as info:
        read_all(source)
    err = info.value
    assert f"{path}:358:" in str(err) and "not-a-number" in str(err)
    assert (err.path, err.line) == (path, 358)
    assert isinstance(err.__cause__, ValueError)
    assert isinstance(err, TorchtunePipeError) and isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert (again.path, again.line, str(again)) == (err.path, err.line, str(err))


def test_parse_error_line_in_gzip(tmp_path):
    path = tmp_path / "ints.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("1\n2\n\n4\n")
    with pytest.raises(SourceError, match=r"ints\.txt\.gz:3: ValueError"):
        read_all(LineFileSource(str(path), parse=int))


def test_skip_mode_drops_counts_and_reports_bad_lines(tmp_path, caplog):
    lines = [str(i) for i in range(200)]
    bad = [10, 11, 99, 150, 151, 152, 153, 199]
    for i in bad:
        lines[i] = f"bad{i}"
    path = write(tmp_path / "ints.txt", "\n".join(lines))
    seen: list[SkippedLine] = []
    source = LineFileSource(path, parse=int, on_error="skip", on_skip=seen.append, chunk_bytes=50)
    with caplog.at_level(logging.WARNING, logger=linefiles_module.__name__):
        results = [read_with_stats(source, unit) for unit in source.units()]
    items = [x for got, _ in results for x in got]
    assert items == [i for i in range(200) if i not in bad]
    assert sum(stats.skipped for _, stats in results) == len(bad)
    assert sum(stats.lines for _, stats in results) == 200
    assert [s.line for s in seen] == [i + 1 for i in bad]
    assert seen[0] == SkippedLine(
        path, 11, "ValueError: invalid literal for int() with base 10: b'bad10'"
    )
    assert len(caplog.records) == 5  # a few warnings, not one per bad line


def count_parser(lines: list[bytes]) -> int:
    """A batch parser that names the bad lines of its batch."""
    bad = {i: f"{line!r} is odd" for i, line in enumerate(lines) if int(line) % 2}
    if bad:
        raise BadLinesError(bad)
    return len(lines)


def strict_sum(lines: list[bytes]) -> int:
    """A batch parser that fails with a bare exception on any bad line."""
    return sum(int(line) for line in lines)


def test_batch_parser_bad_lines_raise_with_line_or_are_dropped(tmp_path):
    path = write(tmp_path / "n.txt", "".join(f"{2 * i}\n" for i in range(40)) + "7\n8\n9\n")
    with pytest.raises(SourceError, match=r"n\.txt:41: b'7' is odd"):
        read_all(LineFileSource(path, parse_batch=count_parser, batch_lines=16))
    skipping = LineFileSource(path, parse_batch=count_parser, batch_lines=16, on_error="skip")
    assert read_all(skipping) == [16, 16, 9]  # 43 lines, 2 dropped from the last batch


def test_batch_parser_bare_exception_is_located_line_by_line(tmp_path):
    path = write(tmp_path / "n.txt", "1\n2\nthree\n4\nfive\n6\n")
    with pytest.raises(SourceError, match=r"n\.txt:3: ValueError"):
        read_all(LineFileSource(path, parse_batch=strict_sum, batch_lines=4))
    skipping = LineFileSource(path, parse_batch=strict_sum, batch_lines=4, on_error="skip")
    assert read_all(skipping) == [1 + 2 + 4, 6]


def test_source_pickles_small_and_reads_the_same(tmp_path):
    path = write(tmp_path / "a.txt", "".join(f"{i}\n" for i in range(1000)))
    source = LineFileSource(path, parse=int, chunk_bytes=128, batch_lines=10)
    blob = pickle.dumps(source)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone.units() == source.units()
    assert read_all(clone) == read_all(source) == list(range(1000))
    unit_blob = pickle.dumps(source.units()[3])
    assert pickle.loads(unit_blob) == source.units()[3]


def test_remote_latency_waits_once_per_unit(tmp_path, monkeypatch):
    path = write(tmp_path / "a.txt", "".join(f"{i}\n" for i in range(100)))
    waits = []
    monkeypatch.setattr(linefiles_module.time, "sleep", waits.append)
    source = LineFileSource(path, chunk_bytes=64, remote_latency_s=0.25)
    assert len(read_all(source)) == 100
    assert waits == [0.25] * len(source.units())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"batch_lines": 0}, "batch_lines"),
        ({"on_error": "ignore"}, "on_error"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"parse": int, "parse_batch": len, "batch_lines": 2}, "not both"),
        ({"parse_batch": len}, "needs batch_lines"),
        ({"remote_latency_s": -1}, "remote_latency_s"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    path = write(tmp_path / "a.txt", "x\n")
    with pytest.raises(ValueError, match=match):
        LineFileSource(path, **kwargs)


def test_bad_lines_error_requires_a_line():
    with pytest.raises(ValueError):
        BadLinesError({})
    err = pickle.loads(pickle.dumps(BadLinesError({3: "x", 1: "y"})))
    assert list(err.reasons) == [1, 3] and "line 1 of the batch: y (and 1 more)" in str(err)
