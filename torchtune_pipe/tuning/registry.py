"""Tuners by name: ``make_tuner("plumber")``, with the names listed in :data:`TUNERS`."""

from __future__ import annotations

from collections.abc import Callable

from torchtune_pipe.tuning.base import Tuner


def _static(**kw) -> Tuner:
    from torchtune_pipe.tuning.baselines import StaticTuner

    return StaticTuner(**kw)


def _unoptimized(**kw) -> Tuner:
    from torchtune_pipe.tuning.baselines import UnoptimizedTuner

    return UnoptimizedTuner(**kw)


def _heuristic(**kw) -> Tuner:
    from torchtune_pipe.tuning.baselines import HeuristicTuner

    return HeuristicTuner(**kw)


def _autotune(adaptive: bool) -> Callable[..., Tuner]:
    def make(**kw) -> Tuner:
        from torchtune_pipe.tuning.autotune import AutotuneTuner

        return AutotuneTuner(adaptive=adaptive, **kw)

    return make


def _plumber(adaptive: bool) -> Callable[..., Tuner]:
    def make(**kw) -> Tuner:
        from torchtune_pipe.tuning.plumber import PlumberTuner

        return PlumberTuner(adaptive=adaptive, **kw)

    return make


def _oracle(**kw) -> Tuner:
    from torchtune_pipe.tuning.oracle import OracleTuner

    return OracleTuner(**kw)


def _intune(**kw) -> Tuner:
    # Imported here: the DQN tuner pulls in torch, which the other tuners do not need.
    from torchtune_pipe.tuning.intune.agent import InTuneTuner

    return InTuneTuner(**kw)


def _planner(**kw) -> Tuner:
    # The InTune tuner with the planner in the network's place (its ablation): each step the
    # plan (tuning/planner.py) when it promises more, under the same undo, guard and rescale.
    from torchtune_pipe.tuning.intune.agent import InTuneTuner

    return InTuneTuner(plan_only=True, **kw)


def _network_only(**kw) -> Tuner:
    # The InTune tuner with the plan action shut (its other ablation): the network's moves
    # alone, under the same undo, guard and rescale.
    from torchtune_pipe.tuning.intune.agent import InTuneTuner

    return InTuneTuner(plan_action=False, **kw)


_FACTORIES: dict[str, Callable[..., Tuner]] = {
    "static": _static,
    "unoptimized": _unoptimized,
    "heuristic": _heuristic,
    "autotune": _autotune(False),
    "autotune-adaptive": _autotune(True),
    "plumber": _plumber(False),
    "plumber-adaptive": _plumber(True),
    "oracle": _oracle,
    "intune": _intune,
    "planner": _planner,
    "network-only": _network_only,
}

TUNERS: tuple[str, ...] = tuple(_FACTORIES)


def make_tuner(name: str, **kw) -> Tuner:
    """Create the tuner called ``name`` with keyword options for its constructor.

    Args:
        name: one of :data:`TUNERS`.
        **kw: passed to the tuner's class (e.g. ``workers=(2, 4, 1)`` for ``static``).

    Raises:
        ValueError: for an unknown name.

    Example:
        >>> tuner = make_tuner("autotune", algorithm="stage_based")
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"make_tuner(): unknown tuner {name!r}; choose one of {', '.join(TUNERS)}"
        ) from None
    return factory(**kw)
