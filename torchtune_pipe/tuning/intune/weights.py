"""The InTune agent's weights: where the shipped files live and how a tuner loads them.

One weight file per pipeline length (``intune_{n}stages.pt``), written by
``python -m torchtune_pipe.tuning.intune.pretrain``; a length without one is tuned by the planner alone
(:class:`PlannerOnly`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchtune_pipe.tuning.intune.dqn import DQNAgent

WEIGHTS_DIR = Path(__file__).parent / "trained"


class PlannerOnly:
    """Stands in for the agent where no weights exist for a pipeline length: always the
    no-op, so the planner's jumps (taken without asking the network, ``plan_gain``), the
    undo rule and the guard steer the pipeline alone."""

    training_enabled = False

    def act(self, state: torch.Tensor, mask: torch.Tensor, epsilon: float = 0.0) -> int:
        return 0

    def epsilon(self, step: int) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {}


def shipped_lengths(directory: Path = WEIGHTS_DIR) -> list[int]:
    """Pipeline lengths (stage counts) with weights in ``directory``."""
    found = (
        p.name.removeprefix("intune_").removesuffix("stages.pt")
        for p in Path(directory).glob("intune_*stages.pt")
    )
    return sorted(int(n) for n in found if n.isdigit())


def weights_path(n_stages: int, directory: Path = WEIGHTS_DIR) -> Path:
    """Where the shipped weights for an ``n_stages`` pipeline live."""
    return Path(directory) / f"intune_{n_stages}stages.pt"


def load_agent(
    weights: str | Path | Mapping[str, Any] | None, n_stages: int
) -> DQNAgent | PlannerOnly:
    """The agent for an ``n_stages`` pipeline from ``weights`` (a file, a directory of
    ``intune_{n}stages.pt`` files, a state dict, or None for the shipped weights).

    Returns:
        The agent; :class:`PlannerOnly` when ``weights`` is None and no weights ship for
        this length.

    Raises:
        FileNotFoundError: ``weights`` names no file for this length.
        ValueError: the weights are for another pipeline length.
    """
    n = n_stages
    if isinstance(weights, Mapping):
        state = weights
    else:
        path = Path(weights) if weights is not None else WEIGHTS_DIR
        if path.is_dir():
            path = weights_path(n, path)
        if weights is None and not path.is_file():
            return PlannerOnly()
        if not path.is_file():
            raise FileNotFoundError(
                f"InTuneTuner: no pre-trained weights for {n} stages at {path}; train them "
                f"with `python -m torchtune_pipe.tuning.intune.pretrain --stages {n} --out DIR` and "
                "pass weights=DIR"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
    if "agent" in state:
        if int(state["n_stages"]) != n:
            raise ValueError(
                f"InTuneTuner: weights are for {state['n_stages']} stages, the pipeline has {n}"
            )
        state = state["agent"]
    return DQNAgent.from_state_dict(state)
