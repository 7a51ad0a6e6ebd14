"""Criteo parsing on real sample rows, malformed rows, the generator, the UDFs and the Batch."""

from __future__ import annotations

import gzip
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from examples.dlrm import generate as gen
from examples.dlrm.criteo import (
    DEFAULT_TABLE_SIZES,
    MISSING_ID,
    MISSING_ROW,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_KEYS,
    AddNoise,
    CriteoChunk,
    CriteoRow,
    CriteoSource,
    ExtraCost,
    HashIds,
    add_noise,
    default_table_sizes,
    hash_ids,
    log_dense,
    parse_row,
    parse_rows,
    rebatch,
    shuffle_rows,
    to_torchrec_batch,
)
from torchtune_pipe.errors import BadLinesError, SourceError

# Real rows shipped with the tests (tests/data/criteo/README.md says where they come from).
DATA = Path(os.environ.get("CRITEO_SAMPLES", Path(__file__).parents[1] / "data" / "criteo"))
needs_samples = pytest.mark.skipif(not DATA.is_dir(), reason=f"no Criteo samples in {DATA}")


def read_source(source: CriteoSource) -> CriteoChunk:
    return CriteoChunk.concat([c for unit in source.units() for c in source.read(unit)])


def hexes(*ids: str) -> list[int]:
    return [int(x, 16) if x else MISSING_ID for x in ids]


def same(a: CriteoChunk, b: CriteoChunk) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("labels", "dense", "sparse"))


@pytest.fixture(scope="module")
def train() -> CriteoChunk:
    return read_source(CriteoSource(str(DATA / "sample_train.txt"), chunk_rows=32))


@pytest.fixture(scope="module")
def test_rows() -> CriteoChunk:
    return read_source(CriteoSource(str(DATA / "sample_test.txt"), chunk_rows=7, chunk_bytes=999))


@needs_samples
def test_sample_train_rows_checked_by_hand(train):
    assert len(train) == 100 and train.labels.sum() == 29
    assert train.labels.dtype == train.dense.dtype == train.sparse.dtype == np.int64
    # Row 1: 0 \t \t 0 \t 5 \t 4 \t 13275 ... (I1 and I10 empty, C22 empty)
    assert train.labels[0] == 0
    assert train.dense[0].tolist() == [0, 0, 5, 4, 13275, 14, 35, 4, 41, 0, 4, 0, 4]
    assert train.sparse[0].tolist() == hexes(
        "05db9164", "f0cf0024", "6f67f7e5", "41274cd7", "25c83c98", "fbad5c96", "25c8362c",
        "0b153874", "a73ee510", "0e97bb27", "ba0f9e8a", "623049e6", "4e4dd817", "b28479f6",
        "e6c5b5cd", "c92f3b61", "3486227d", "b04e4670", "21ddcdc9", "b1252a9d", "60f6221e",
        "", "32c7478e", "43f13e8b", "ea9a246c", "731c3655",
    )  # fmt: skip
    # Row 2 is a positive with every count present.
    assert train.labels[1] == 1
    assert train.dense[1].tolist() == [0, 559, 2, 7, 2532, 164, 98, 6, 943, 0, 18, 0, 7]
    assert train.sparse[1, [0, 21, 25]].tolist() == hexes("68fd1e64", "", "c84c4aec")
    # Row 4 has C19, C20, C22, C25, C26 missing (empty fields, 40 fields kept).
    assert train.dense[3].tolist() == [0, 72, 2, 2, 0, 0, 0, 4, 12, 0, 0, 0, 2]
    assert train.sparse[3, [18, 19, 20, 21, 22, 23, 24, 25]].tolist() == hexes(
        "", "", "f0474b68", "ad3062eb", "32c7478e", "53c37c32", "", ""
    )
    assert (train.dense[:, 1] == -1).sum() > 0  # I2 keeps its negative counts


@needs_samples
def test_sample_test_accepts_stripped_rows_and_no_final_newline(test_rows):
    raw = (DATA / "sample_test.txt").read_bytes()
    assert not raw.endswith(b"\n")
    lines = raw.split(b"\n")
    stripped = [i for i, line in enumerate(lines) if line.count(b"\t") < 39]
    assert len(stripped) == 39
    assert len(test_rows) == 100 and test_rows.labels.sum() == 36
    assert test_rows.dense[0].tolist() == [1, 1, 26, 30, 0, 4, 2, 37, 152, 1, 2, 0, 2]
    assert test_rows.sparse[0, [0, 5, 21, 25]].tolist() == hexes("05db9164", "", "", "c4304c4b")
    for i in stripped:  # the stripped trailing fields read as missing
        present = lines[i].count(b"\t") + 1 - 1 - NUM_DENSE
        assert (test_rows.sparse[i, present:] == MISSING_ID).all()
    last = lines[-1].split(b"\t")
    assert test_rows.labels[-1] == int(last[0])


@needs_samples
def test_vectorised_parser_matches_row_parser_on_samples():
    for name in ("sample_train.txt", "sample_test.txt"):
        lines = (DATA / name).read_bytes().rstrip(b"\n").split(b"\n")
        assert same(parse_rows(lines), CriteoChunk.from_rows([parse_row(x) for x in lines]))


def test_parser_edge_cases():
    row = b"1\t-7\t\t12345678901\t\t\t\t\t\t\t\t\t\t\tABCDEF01\t0\r"
    chunk = parse_rows([row])
    assert chunk.dense[0, :3].tolist() == [-7, 0, 12345678901]
    assert chunk.sparse[0, :3].tolist() == [0xABCDEF01, 0, MISSING_ID]
    assert same(chunk, CriteoChunk.from_rows([parse_row(row)]))
    assert len(parse_rows([])) == 0
    assert parse_row(b"0") == CriteoRow(0, (0,) * NUM_DENSE, (MISSING_ID,) * NUM_SPARSE)


def test_malformed_rows_are_all_named():
    good = b"0\t1" + b"\t" * 38
    bad = [
        good,
        b"1\t2\tzz",
        good + b"\t5",
        b"",
        b"2\t1",
        b"0\t1.5",
        b"0\t-",
        b"0" + b"\t" * 14 + b"123456789",
        b"1" + b"\t" * 14 + b"-1",
    ]
    with pytest.raises(BadLinesError) as info:
        parse_rows(bad)
    assert info.value.reasons == {
        1: "I2 'zz' is not an integer",
        2: "41 fields, expected at most 40",
        3: "empty line",
        4: "label '2' is not 0 or 1",
        5: "I1 '1.5' is not an integer",
        6: "I1 '-' is not an integer",
        7: "C1 '123456789' is not a hex id of at most 8 digits",
        8: "C1 '-1' is not a hex id of at most 8 digits",
    }
    with pytest.raises(ValueError, match="C1 '-1'"):
        parse_row(bad[8])


@needs_samples
def test_source_reports_file_and_line_or_skips_and_counts(tmp_path):
    lines = (DATA / "sample_train.txt").read_bytes().rstrip(b"\n").split(b"\n")
    lines[41] = lines[41].replace(b"\t", b"\tx", 1)  # line 42: I1 is not an integer
    lines[76] = b"1\t" + lines[76]  # line 77: 41 fields
    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\r\n".join(lines) + b"\r\n")
    with pytest.raises(SourceError, match=r"day_0\.gz:42: I1 'x\d*' is not an integer") as info:
        read_source(CriteoSource(str(path), chunk_rows=16))
    assert info.value.line == 42
    skipped = []
    source = CriteoSource(str(path), chunk_rows=16, on_error="skip", on_skip=skipped.append)
    chunk = read_source(source)
    assert len(chunk) == 98 and [s.line for s in skipped] == [42, 77]
    assert "41 fields" in skipped[1].error
    clean = np.delete(np.arange(100), [41, 76])
    assert same(chunk, parse_rows([lines[i] for i in clean]))


def test_generator_is_deterministic_by_seed(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.txt", "b.txt", "c.txt"))
    gen.generate(a, 3000, seed=7)
    gen.generate(b, 3000, seed=7)
    gen.generate(c, 3000, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    gen.generate(tmp_path / "a.gz", 3000, seed=7, gzip=True)
    gen.generate(tmp_path / "b.gz", 3000, seed=7, gzip=True)
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()
    assert gzip.decompress((tmp_path / "a.gz").read_bytes()) == a.read_bytes()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, CriteoChunk]:
    path = tmp_path_factory.mktemp("gen") / "train.txt"
    start = time.perf_counter()
    report = gen.generate(path, 100_000, seed=0)
    elapsed = time.perf_counter() - start
    print(f"\ngenerated 100k rows ({report.bytes_written / 1e6:.1f} MB) in {elapsed:.2f} s")
    chunk = read_source(CriteoSource(str(path), chunk_rows=8192, chunk_bytes=4 << 20))
    assert report.rows == len(chunk) == 100_000 and report.positives == chunk.labels.sum()
    return path, chunk


def test_generator_statistics_look_like_criteo(synthetic):
    path, chunk = synthetic
    assert abs(chunk.labels.mean() - 0.256) < 0.015
    missing = chunk.sparse == MISSING_ID
    for j, rate in {2: 0.034, 5: 0.12, 18: 0.44, 21: 0.76, 0: 0.0}.items():
        assert abs(missing[:, j].mean() - rate) < 0.015, j
    assert (missing[:, 18] == missing[:, 25]).all()  # C19 and C26 go missing together
    assert abs((chunk.dense[:, 1] == -1).mean() - 0.095) < 0.01
    assert (chunk.dense[:, [0, 2, 3, 4]] >= 0).all() and chunk.dense[:, 4].max() > 100_000
    # Power-law head: on a 10M-id feature the top id is common and frequencies fall off
    # roughly as rank^-1.15 (rank 1 vs rank 10: about 14x).
    _, counts = np.unique(chunk.sparse[:, 2][~missing[:, 2]], return_counts=True)
    top = np.sort(counts)[::-1]
    assert top[0] / len(chunk) > 0.05
    assert 6 < top[0] / top[9] < 30
    assert len(counts) > 20_000  # and a long tail
    lines = path.read_bytes().split(b"\n")[:-1]
    nfields = np.array([line.count(b"\t") + 1 for line in lines])
    assert 0.05 < (nfields < 40).mean() < 0.3 and nfields.max() == 40


def test_generated_labels_are_learnable(tmp_path, synthetic):
    torch = pytest.importorskip("torch")
    from torchmetrics.functional.classification import binary_auroc

    train = synthetic[1].take(slice(0, 30_000))
    gen.generate(tmp_path / "held_out.txt", 10_000, seed=1)
    test = read_source(CriteoSource(str(tmp_path / "held_out.txt")))
    sizes = default_table_sizes(cap=200)  # small tables: few, well-trained rows
    offsets = torch.tensor(np.cumsum([0, *sizes[:-1]]))

    def features(chunk):
        chunk = log_dense(hash_ids(chunk, sizes))
        return torch.from_numpy(chunk.dense), torch.from_numpy(chunk.sparse) + offsets

    torch.manual_seed(0)
    emb = torch.nn.Embedding(sum(sizes), 1)  # logistic regression on one-hot ids + counts
    torch.nn.init.zeros_(emb.weight)
    linear = torch.nn.Linear(NUM_DENSE, 1)
    opt = torch.optim.Adam([*emb.parameters(), *linear.parameters()], lr=0.1)
    dense, ids = features(train)
    labels = torch.from_numpy(train.labels).float()
    for _ in range(30):
        logits = emb(ids).sum((1, 2)) + linear(dense).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dense, ids = features(test)
    with torch.no_grad():
        logits = emb(ids).sum((1, 2)) + linear(dense).squeeze(1)
    auroc = binary_auroc(logits, torch.from_numpy(test.labels)).item()
    print(f"held-out AUROC after 30 full-batch steps: {auroc:.3f}")
    assert auroc > 0.65


def test_udfs():
    chunk = parse_rows(
        [b"1\t-3\t0\t9" + b"\t" * 11 + b"ffffffff", b"0\t5" + b"\t" * 13 + b"abc\t" + b"\t" * 24]
    )
    hashed = hash_ids(chunk)
    sizes = np.array(DEFAULT_TABLE_SIZES)
    assert max(DEFAULT_TABLE_SIZES) == 100_001 and min(DEFAULT_TABLE_SIZES) == 4
    assert hashed.sparse[0, 0] == 1 + 0xFFFFFFFF % (sizes[0] - 1)
    assert hashed.sparse[0, 1] == MISSING_ROW and hashed.sparse[1, 1] == MISSING_ROW
    assert hashed.sparse[1, 0] == 1 + 0xABC % (sizes[0] - 1)
    assert ((hashed.sparse >= 0) & (hashed.sparse < sizes)).all()
    assert HashIds()(chunk).sparse.tolist() == hashed.sparse.tolist()
    with pytest.raises(ValueError, match="table_sizes"):
        hash_ids(chunk, [1] * NUM_SPARSE)
    logged = log_dense(chunk)
    assert logged.dense.dtype == np.float32
    np.testing.assert_allclose(logged.dense[0, :3], [0.0, 0.0, np.log(10)], rtol=1e-6)
    noisy = add_noise(logged, std=0.5, seed=1)
    assert np.array_equal(noisy.dense, AddNoise(0.5, 1)(logged).dense)
    assert not np.array_equal(noisy.dense, add_noise(logged, std=0.5, seed=2).dense)
    assert abs(float((noisy.dense - logged.dense).std()) - 0.5) < 0.3
    for fn in (HashIds(), AddNoise(), ExtraCost(10), hash_ids, log_dense):
        assert pickle.loads(pickle.dumps(fn)) == fn


def test_extra_cost_burns_cpu_time():
    chunk = parse_rows([b"0"] * 100)
    before = time.thread_time_ns()
    assert ExtraCost(cpu_ns_per_row=20_000)(chunk) is chunk
    assert time.thread_time_ns() - before >= 100 * 20_000
    with pytest.raises(ValueError, match="cpu_ns_per_row"):
        ExtraCost(-1)


def test_shuffle_and_rebatch_keep_every_row():
    chunk = CriteoChunk(np.arange(10), np.zeros((10, NUM_DENSE)), np.zeros((10, NUM_SPARSE)))
    shuffled = shuffle_rows(chunk, seed=0)
    assert sorted(shuffled.labels.tolist()) == list(range(10))
    assert shuffled.labels.tolist() != list(range(10))
    assert shuffle_rows(chunk, seed=0).labels.tolist() == shuffled.labels.tolist()
    parts = [chunk.take(slice(0, 3)), chunk.take(slice(3, 4)), chunk.take(slice(4, 10))]
    batches = list(rebatch(iter(parts), 4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert np.concatenate([b.labels for b in batches]).tolist() == list(range(10))
    assert [len(b) for b in rebatch(iter(parts), 4, drop_last=True)] == [4, 4]


def test_torchrec_batch_shapes_dtypes_and_keys():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    rows = [
        b"1\t3\t\t-1" + b"\t" * 11 + b"0000000a\t\t" + b"00000002",
        b"0\t\t1" + b"\t" * 12 + b"b",
    ]
    chunk = log_dense(hash_ids(parse_rows(rows)))
    batch = to_torchrec_batch(chunk)
    assert batch.dense_features.shape == (2, NUM_DENSE)
    assert batch.dense_features.dtype == torch.float32
    assert batch.labels.dtype == torch.float32 and batch.labels.tolist() == [1.0, 0.0]
    kjt = batch.sparse_features
    assert kjt.keys() == list(SPARSE_KEYS) and kjt.stride() == 2
    assert kjt.lengths().tolist() == [1] * (2 * NUM_SPARSE)
    assert kjt.values().dtype == torch.int64
    assert kjt.values().tolist() == chunk.sparse.T.reshape(-1).tolist()  # key-major
    assert kjt["cat_0"].values().tolist() == chunk.sparse[:, 0].tolist()
    assert kjt["cat_1"].values().tolist() == [MISSING_ROW, MISSING_ROW]
    raw = to_torchrec_batch([parse_row(r) for r in rows])  # rows, not hashed: -1 -> 0
    assert raw.sparse_features["cat_1"].values().tolist() == [MISSING_ROW, MISSING_ROW]
    assert raw.sparse_features["cat_0"].values().tolist() == [10, 11]
    pinned = batch.to("cpu")
    assert pinned.dense_features.shape == (2, NUM_DENSE)


def test_torchrec_dlrm_trains_on_a_batch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    sizes = default_table_sizes(cap=50)
    rows = gen._World().draw(np.random.default_rng(0), 64)
    chunk = CriteoChunk(rows[0], np.where(rows[2], 0, rows[1]), np.where(rows[4], -1, rows[3]))
    batch = to_torchrec_batch(log_dense(hash_ids(chunk, sizes)))
    tables = [
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=4, num_embeddings=n, feature_names=[k])
        for k, n in zip(SPARSE_KEYS, sizes, strict=True)
    ]
    model = DLRMTrain(DLRM(EmbeddingBagCollection(tables=tables), NUM_DENSE, [8, 4], [8, 1]))
    loss, (_, logits, labels) = model(batch)
    loss.backward()
    assert logits.shape == (64,) and torch.isfinite(loss)
