"""The options objects: one definition of the shared stage knobs and of the Loader's
strategies, given whole or field by field."""

from __future__ import annotations

import pytest

from torchtune_pipe import Pipeline, StageOptions, Strategy
from torchtune_pipe.errors import PipelineError

ITEMS = list(range(40))


def test_stage_options_given_whole_or_by_keyword_make_the_same_stage():
    io = StageOptions(workers=2, max_workers=4, concurrency=2, max_concurrency=8)
    whole = Pipeline.from_source(ITEMS, options=io).map(abs, options=io)
    by_kw = Pipeline.from_source(
        ITEMS, workers=2, max_workers=4, concurrency=2, max_concurrency=8
    ).map(abs, workers=2, max_workers=4, concurrency=2, max_concurrency=8)
    assert whole.stages == by_kw.stages
    # A keyword overrides the object's field, and only that one.
    st = Pipeline.from_source(ITEMS, options=io, workers=3).stages[0]
    assert (st.workers, st.max_workers, st.max_concurrency) == (3, 4, 8)


def test_an_unknown_stage_option_is_named():
    with pytest.raises(TypeError, match=r"map\(\): unexpected keyword argument 'wokers'.*workers"):
        Pipeline.from_source(ITEMS).map(abs, wokers=2)
    with pytest.raises(TypeError, match=r"options must be a StageOptions, got dict"):
        Pipeline.from_source(ITEMS, options={"workers": 2})


def test_stage_options_are_validated_where_they_are_used():
    with pytest.raises(PipelineError, match=r"map\('f'\): need min_workers <= workers"):
        Pipeline.from_source(ITEMS).map(
            abs, name="f", options=StageOptions(workers=5, max_workers=2)
        )


def test_loader_strategy_whole_or_by_keyword():
    pipe = Pipeline.from_source(ITEMS)
    with pipe.loader(strategy=Strategy(inline=True)) as a, pipe.loader(inline=True) as b:
        assert a.strategy == b.strategy == Strategy(inline=True)
        assert sorted(a) == sorted(b) == ITEMS
    with pytest.raises(TypeError, match=r"Loader: unexpected keyword argument 'fast_strat'"):
        pipe.loader(fast_strat=True)
    with pytest.raises(TypeError, match=r"Strategy: inline must be a bool, got 1"):
        Strategy(inline=1)  # type: ignore[arg-type]
