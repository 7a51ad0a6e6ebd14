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
    script = tmp_path / f"{name}.py"
    script.write_text(snippets()[name])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
