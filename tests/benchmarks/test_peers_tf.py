"""The tf.data contenders' wiring in the peers benchmark, tested without TensorFlow."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from benchmarks import _peers_tf, _peers_watch, peers
from examples.dlrm.pipeline import Features
from torchtune_pipe.sources.base import LineFileSource

NO_TF_HERE = importlib.util.find_spec("tensorflow") is None
ARGS = SimpleNamespace(extra_cost_ns=20_000, latency_s=0.02, mem_growth_mib=256)


def tf_contender(tool: str = "tfdata-ops", python: str = "/envs/tf/bin/python"):
    return peers.Contender(tool, tool, python=python)


@pytest.mark.parametrize("scenario", peers.CRITEO_SCENARIOS)
@pytest.mark.parametrize("quick", [False, True])
def test_tfdata_runs_in_every_scenario_only_when_tensorflow_is_there(scenario, quick):
    with_tf = peers.contenders(scenario, 2, quick, spdl=False, tf_python="/envs/tf/bin/python")
    tf_rows = [c for c in with_tf if c.tool in peers.TF_TOOLS]
    assert [c.label for c in tf_rows] == ["tfdata-ops", "tfdata-pyfunc"]
    assert {c.python for c in tf_rows} == {"/envs/tf/bin/python"}
    assert all(c.python is None for c in with_tf if c.tool not in peers.TF_TOOLS)
    without = peers.contenders(scenario, 2, quick, spdl=False, tf_python=None)
    assert [c for c in with_tf if c.tool not in peers.TF_TOOLS] == without


def test_tf_contenders_run_their_own_python_on_the_tf_script():
    env = {"PYTHONPATH": "/some/site-packages", "HOME": "/root"}
    argv, child_env = peers.child_command(tf_contender(), "/w/x.spec", env)
    assert argv == ["/envs/tf/bin/python", str(peers.TF_SCRIPT), "/w/x.spec"]
    assert peers.TF_SCRIPT.is_file()
    assert child_env["PYTHONPATH"] == str(peers.REPO)  # not the other env's site-packages
    assert child_env["HOME"] == "/root"
    argv, child_env = peers.child_command(peers.Contender("nodes-w2", "nodes", 2), "s", env)
    assert argv == [sys.executable, "-m", "benchmarks._peers_fns", "s"]
    assert child_env is env


@pytest.mark.parametrize("scenario", peers.CRITEO_SCENARIOS)
@pytest.mark.parametrize("tool", peers.TF_TOOLS)
def test_the_tf_child_gets_every_field_it_reads(scenario, tool):
    spec, _ = peers.scenario_spec(scenario, peers.base_spec(["/d/day_0.txt"], 2.0), ARGS)
    child = peers.child_spec(tf_contender(tool), spec, "/w/out.json")
    assert set(_peers_tf.SPEC_FIELDS) <= set(child)
    assert child["tool"] == tool and child["out"] == "/w/out.json"
    assert tuple(child["table_sizes"]) == Features().table_sizes  # the sizes Features hashes into
    assert child["batch_size"] % child["chunk_rows"] == 0
    if scenario in ("udf", "rescale"):
        assert child["extra_cost_ns"] == ARGS.extra_cost_ns
    if scenario == "latency":
        assert child["latency_s"] == ARGS.latency_s
    if scenario == "memory":
        assert child["step_s"] > 0 and child["batch_size"] == peers.MEMORY_BATCH_ROWS
        assert child["duration_s"] >= peers.MEMORY_WINDOW_S
    json.dumps(child)  # it travels as JSON


def test_tf_unavailable_says_why(tmp_path):
    missing = str(tmp_path / "no-env" / "python")
    assert "does not exist" in peers.tf_unavailable(missing)
    if NO_TF_HERE:  # the main environment never has TensorFlow
        why = peers.tf_unavailable(sys.executable)
        assert why is not None and "cannot import tensorflow" in why


def test_run_one_launches_the_tf_script_and_reports_its_crash(tmp_path):
    # This interpreter stands in for the TF one: the script runs, fails to import TensorFlow,
    # and its result file carries the error, as a real TF crash would.
    if not NO_TF_HERE:
        pytest.skip("this environment has TensorFlow")
    path = tmp_path / "day.txt"
    path.write_bytes(b"0" + b"\t" * 39 + b"\n")
    spec = peers.base_spec([str(path)], 1.0)
    c = tf_contender(python=sys.executable)
    m = peers.run_one(c, spec, {}, dict(os.environ), str(tmp_path))
    assert m["label"] == "tfdata-ops" and m["samples_per_s"] == 0.0
    assert "tensorflow" in m["crash"].lower()


def _write(path, lines: list[bytes], trailing_newline: bool = True) -> str:
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing_newline else b""))
    return str(path)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 33, 1000])
def test_line_units_hold_exactly_the_lines_of_the_source_units(tmp_path, chunk_bytes):
    rng = np.random.default_rng(chunk_bytes)
    lines = [b"x" * int(n) for n in rng.integers(1, 40, size=30)]
    a = _write(tmp_path / "a.txt", lines)
    b = _write(tmp_path / "b.txt", lines[:7], trailing_newline=False)
    src = LineFileSource([a, b], chunk_bytes=chunk_bytes, parse=bytes)
    expected = [u for u in (list(src.read(u)) for u in src.units(0)) if u]
    got = []
    for path, begin, end in _peers_tf.line_units([a, b], chunk_bytes):
        with open(path, "rb") as f:
            f.seek(begin)
            got.append(f.read(end - begin).rstrip(b"\n").split(b"\n"))
    assert got == expected
    assert sum(map(len, got)) == 37  # every line once


def test_line_units_reject_gzip_and_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes"):
        _peers_tf.line_units([], 0)
    gz = tmp_path / "day.gz"
    gz.write_bytes(b"")
    with pytest.raises(ValueError, match="gzip"):
        _peers_tf.line_units([str(gz)], 10)


class _Batches:
    """Stands in for a TF pipeline: epochs of ``(dense, sparse, labels)`` batches."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.epochs = 0

    def build(self, spec: dict):
        def epoch_iter(epoch: int):
            self.epochs += 1
            return iter([(None, None, np.zeros(n)) for n in self.sizes])

        return epoch_iter, lambda: None


def test_consume_times_the_window_after_the_first_batch(tmp_path):
    ticks = iter(range(10_000))
    out = str(tmp_path / "r.json")
    fake = _Batches([512, 512, 100])
    spec = {"duration_s": 20, "out": out}
    result = _peers_tf.consume(spec, fake.build, clock=lambda: float(next(ticks)))
    assert result["error"] is None
    assert os.path.exists(out + ".first")
    times, rows = result["times"], result["rows"]
    assert rows[:4] == [512, 512, 100, 512]  # epoch after epoch
    assert fake.epochs > 1
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] - times[0] <= 20 + 2  # stops at the deadline


def test_consume_reports_a_failed_build():
    def broken(spec):
        raise RuntimeError("no TensorFlow here")

    result = _peers_tf.consume({"duration_s": 1}, broken)
    assert result["times"] == [] and "no TensorFlow here" in result["error"]


def test_build_names_a_missing_field_or_an_unknown_tool():
    spec = {k: 1 for k in _peers_tf.SPEC_FIELDS}
    with pytest.raises(ValueError, match="table_sizes"):
        _peers_tf.build({k: v for k, v in spec.items() if k != "table_sizes"})
    with pytest.raises(ValueError, match="unknown tool 'spdl'"):
        _peers_tf.build(dict(spec, tool="spdl"))


def test_main_writes_the_result_atomically(tmp_path):
    out = str(tmp_path / "r.json")
    spec_path = tmp_path / "s.json"
    spec_path.write_text(json.dumps({"tool": "nope", "duration_s": 1, "out": out}))
    assert _peers_tf.main([str(spec_path)]) == 3  # a bad spec is a reported crash
    result = json.loads(open(out).read())
    assert set(result) == {"times", "rows", "error"} and "lacks" in result["error"]
    assert not os.path.exists(out + ".tmp")


def test_headline_and_markdown_include_tfdata():
    rows = [
        {"label": "tfdata-ops", "tool": "tfdata-ops", "samples_per_s": 200.0, "crash": None},
        {"label": "tfdata-pyfunc", "tool": "tfdata-pyfunc", "samples_per_s": 50.0,
         "crash": None},
        {"label": "torchtune_pipe-intune", "tool": "torchtune_pipe", "samples_per_s": 300.0,
         "crash": None},
    ]  # fmt: skip
    peers.add_ratios(rows)
    h = peers.headline(rows, cores=2)
    assert h["tfdata_ops"]["intune_ratio"] == pytest.approx(1.5)
    assert h["tfdata_pyfunc"]["intune_ratio"] == pytest.approx(6.0)
    assert rows[0]["vs_intune"] == pytest.approx(2 / 3)
    text = peers.markdown(
        {"scenarios": {}, "not_run": {"tf.data": "not run: /x/python does not exist"}}
    )
    assert "- tf.data: not run: /x/python does not exist" in text


@pytest.mark.timeout(60)
def test_rescale_moves_every_thread_of_a_process():
    # tf.data runs on threads of one process: taking CPUs away must reach its thread pool.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    code = (
        "import sys, threading\n"
        "for _ in range(3): threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        p = psutil.Process(proc.pid)
        _peers_watch.set_affinity([p], cpus[:1])
        tids = [t.id for t in p.threads()]
        assert len(tids) == 4
        assert all(os.sched_getaffinity(tid) == {cpus[0]} for tid in tids)
    finally:
        proc.communicate("", timeout=30)


def test_memory_watchdog_kills_a_tree_that_grows_past_its_allowance(tmp_path):
    marker = tmp_path / "out.first"
    grow = (
        "import pathlib, time\n"
        "time.sleep(1.5)\n"  # past a PSS sample taken before the first batch
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "time.sleep(1.5)\n"  # the watcher records the tree's PSS at the first batch
        "held = bytearray(96 << 20)\n"  # then 96 MiB more, every page touched
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", grow])
    plan = {"first_marker": str(marker), "mem_growth_bytes": 32 << 20}
    watch, done = _peers_watch.TreeWatch(), threading.Event()
    watcher = threading.Thread(target=_peers_watch.watch_tree, args=(proc, plan, done, watch))
    watcher.start()
    try:
        assert proc.wait(timeout=20) != 0  # killed, not finished
    finally:
        done.set()
        watcher.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert watch.pss_at_first is not None
    assert "past its" in watch.killed and "allowed 32" in watch.killed


def test_the_pipeline_module_imports_without_torchrec():
    # tf.data's environment has torch but no TorchRec, and its pyfunc contender imports the
    # DLRM pipeline module for the feature UDFs.
    code = (
        "import sys; sys.modules['torchrec'] = None\n"
        "from examples.dlrm.pipeline import Features\n"
        "print(Features().table_sizes[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=peers.REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
