"""Every runnable README snippet runs as written, as a script, on CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from ._readme import ROOT, snippets

NEEDS = {"callback": "lightning", "remote-stages": "ray"}


def test_the_readme_marks_its_snippets():
    assert set(snippets()) == {"quickstart", "callback", "pipeline", "remote-stages"}
    quick = snippets()["quickstart"].strip().splitlines()
    code = [line for line in quick if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 6  # the import lines and the loop: "five lines" plus the main guard


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name",
    [
        "quickstart",
        pytest.param("callback", marks=pytest.mark.slow),
        "pipeline",
        pytest.param("remote-stages", marks=pytest.mark.slow),
    ],
)
def test_readme_snippet_runs(name, tmp_path):
    need = NEEDS.get(name)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{need} is not installed")
    _run_script(snippets()[name], tmp_path / f"{name}.py")


def _run_script(code: str, script) -> subprocess.CompletedProcess:
    """Run ``code`` as the script ``script`` (in its folder, the repository importable); it
    must exit with 0."""
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_callback_snippet_with_limit_train_batches_runs_every_epoch(tmp_path):
    # An epoch that Lightning ends early (limit_train_batches) leaves a loader whose next
    # epochs run whole, with no error from the tuning loop.
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    code = snippets()["callback"]
    line = "L.Trainer(max_epochs=2,"
    assert line in code
    code = code.replace(line, "L.Trainer(max_epochs=3, limit_train_batches=5,")
    code += (
        "    assert trainer.fit_loop.epoch_progress.current.completed == 3\n"
        "    assert sum(1 for _ in loader) == len(loader)  # a whole epoch after them\n"
    )
    done = _run_script(code, tmp_path / "callback_limited.py")
    assert "Traceback" not in done.stderr and "stopped by an error" not in done.stderr, done.stderr
