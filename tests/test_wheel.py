"""A user's first hour, from a wheel: build it, install it into a fresh virtual environment
outside the repository, and run the README's snippets and the shipped demo there.

No network: the wheel is installed with ``--no-deps``, and the fresh environment sees the
test environment's packages (torch, Lightning...) through a ``.pth`` line, after its own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ._readme import ROOT, snippets

pytest.importorskip("setuptools")
pytest.importorskip("wheel")


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 120) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_the_readme_installs_torch_for_the_machine_first_as_make_does():
    # Left to pip, `torch>=2.4` is PyPI's torch: a CUDA build of several GB, even on a CPU box.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    cpu_step = f"pip install torch --index-url {CPU_INDEX}"
    assert cpu_step in section
    assert section.index(cpu_step) < section.index('pip install "torchtune-pipe')
    requirement = re.search(r'"torch(>=[^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert f"`torch{requirement}`" in section  # the supported versions, as pyproject says
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION \?= (\S+)", makefile, re.M)[1]
    assert f"torch=={version}" in section and CPU_INDEX in makefile  # make's path is the same


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    # Build from a copy, so the repository gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("torchtune_pipe", "multiproc"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(src)], tmp_path, env, timeout=180)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("torchtune_pipe-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               tmp_path, env).strip()  # fmt: skip
    # The test environment's packages, after the fresh environment's own.
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "test_env.pth").write_text("\n".join(sorted(parents)) + "\n")
    run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        tmp_path, env)  # fmt: skip

    user = tmp_path / "user"  # the user's project: no repository in sight
    user.mkdir()
    where = run([str(python), "-c", "import torchtune_pipe; print(torchtune_pipe.__file__)"],
                user, env)  # fmt: skip
    assert where.strip().startswith(str(venv)), where
    typed = run([str(python), "-c", "import importlib.resources as r; "
                 "print(r.files('torchtune_pipe').joinpath('py.typed').is_file())"], user, env)  # fmt: skip
    assert typed.strip() == "True"

    names = ["quickstart", "pipeline"]
    if importlib.util.find_spec("lightning") is not None:
        names.append("callback")
    for name in names:
        (user / f"{name}.py").write_text(snippets()[name])
        run([str(python), f"{name}.py"], user, env, timeout=150)

    cli = str(venv / "bin" / "torchtune-pipe")
    assert "generated click logs" in run([cli, "demo", "--help"], user, env)
    out = run([cli, "demo", "--time-budget-s", "3", "--rows", "2000", "--val-rows", "300",
               "--interval-s", "0.2"], user, env, timeout=150)  # fmt: skip
    assert "held-out AUROC" in out and "make demo" in out
    log = (user / "out" / "demo" / "tuning.jsonl").read_text()
    if '"obs"' in log:  # tuned workers
        watched = run([cli, "watch", "out/demo/tuning.jsonl", "--once", "--plain"], user, env)
        assert "fetch" in watched
        if importlib.util.find_spec("matplotlib") is not None:
            reported = run([cli, "report", "out/demo/tuning.jsonl"], user, env)
            assert "stages fetch, collate" in reported
            assert (user / "out" / "demo" / "tuning.png").is_file()
    else:  # "auto" measured reading in the calling process faster: the log says so
        assert '"event": "inline"' in log
        watched = subprocess.run([cli, "watch", "out/demo/tuning.jsonl", "--once"], cwd=user,
                                 env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert watched.returncode == 2 and "reads in the calling process" in watched.stderr
    bench = subprocess.run([cli, "bench"], cwd=user, env=env, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert bench.returncode == 2 and "clone of the torchtune_pipe repository" in bench.stderr
