"""The running pipeline's helpers that need no executor: the Loader's tuner argument."""

from __future__ import annotations

import pytest

from torchtune_pipe.loader.running import as_tuner
from torchtune_pipe.tuning import HeuristicTuner, make_tuner


def test_no_tuner_and_static_keep_the_stages_own_knobs():
    assert as_tuner(None) is None
    assert as_tuner("static") is None  # no loop steps the stages, so nothing clamps them


def test_a_name_is_the_registrys_tuner_and_a_tuner_is_itself():
    assert type(as_tuner("heuristic")) is type(make_tuner("heuristic"))
    tuner = HeuristicTuner()
    assert as_tuner(tuner) is tuner


def test_an_unknown_name_or_object_raises():
    with pytest.raises(ValueError, match="unknown tuner 'nope'"):
        as_tuner("nope")
    with pytest.raises(ValueError, match="tuner must be None, a tuner name or a Tuner"):
        as_tuner(object())
