"""The `torchtune-pipe` command inside and outside a clone of the repository."""

from __future__ import annotations

import pytest

from torchtune_pipe.tools import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "watch", "report", "train", "bench", "peers", "simulate"):
        assert command in out


def test_repository_commands_outside_a_clone_say_where_to_run_them(capsys):
    # The wheel test runs the real command outside the repository; here, a module of the
    # repository that cannot be imported.
    assert cli._import("bench", "benchmarks.not_shipped") is None
    err = capsys.readouterr().err
    assert "clone of the torchtune_pipe repository" in err and "make install" not in err


def test_demo_outside_a_clone_is_the_shipped_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "generated click logs" in out and "make demo" in out
