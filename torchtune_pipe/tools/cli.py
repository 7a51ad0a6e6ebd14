"""The ``torchtune-pipe`` command: demo, watch, report, train, bench, peers, simulate, pretrain.

Each subcommand forwards its remaining arguments to the module that implements it, so
``torchtune-pipe simulate --help`` shows that module's own options. ``demo``, ``watch``,
``report``, ``simulate`` and ``pretrain`` work wherever the package is installed; ``train``,
``bench`` and ``peers`` run the repository's ``examples/`` and ``benchmarks/`` and need a clone
of it (run from its root after ``make install``). ``demo`` runs the repository's TorchRec DLRM
example there, and the demo shipped with the package (:mod:`torchtune_pipe.tools.demo`) elsewhere.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from types import ModuleType

_REPO_DEMO = "examples.dlrm.train"

# subcommand -> (module, function, help)
_COMMANDS = {
    "demo": (
        "torchtune_pipe.tools.demo",
        "main",
        "train a model on generated click logs through a tuned loader (TorchRec's DLRM in a "
        "clone of the repository)",
    ),
    "watch": (
        "torchtune_pipe.tools.watch",
        "main",
        "show a running loader's stages live, from its tuning log",
    ),
    "report": (
        "torchtune_pipe.tools.report",
        "main",
        "plot a tuning log to a PNG: throughput, workers and buffers per stage over time",
    ),
    "train": (_REPO_DEMO, "main", "the DLRM example with all its options (repository)"),
    "bench": (
        "benchmarks.executor",
        "main",
        "executor benchmark: channel bandwidth, tiny items, efficiency, start latency (repository)",
    ),
    "peers": (
        "benchmarks.peers",
        "main",
        "the same Criteo pipeline through DataLoader, torchdata.nodes, SPDL and every tuner "
        "(repository)",
    ),
    "simulate": (
        "torchtune_pipe.sim.studies",
        "main",
        "the InTune paper's studies in the simulator (JSON + PNG)",
    ),
    "pretrain": (
        "torchtune_pipe.tuning.intune.pretrain",
        "main",
        "pre-train the InTune agent in the simulator",
    ),
}
_TORCHREC = (
    "TorchRec for the DLRM example: on CPU `pip install fbgemm-gpu-cpu pyre-extensions iopath "
    "&& pip install --no-deps torchrec` (with CUDA: fbgemm-gpu instead), or `make install`"
)


def _in_repository() -> bool:
    """True when the working directory is a clone of the repository (has ``examples/dlrm``)."""
    return os.path.isfile(os.path.join(os.getcwd(), "examples", "dlrm", "train.py"))


def _repo_demo() -> ModuleType | None:
    """The repository's DLRM example, when run from a clone with TorchRec installed."""
    if not _in_repository() or importlib.util.find_spec("torchrec") is None:
        return None
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(_REPO_DEMO)


def _import(command: str, module: str) -> ModuleType | None:
    if not module.startswith("torchtune_pipe") and _in_repository():
        if os.getcwd() not in sys.path:
            # examples/ and benchmarks/ live in the repository, not in the installed package.
            sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if missing in ("examples", "benchmarks"):
            hint = (
                f"`{command}` runs the repository's {missing}/, which the installed package does "
                "not ship: run it from the root of a clone of the torchtune_pipe repository"
            )
        elif missing == "torchrec":
            hint = _TORCHREC
        else:
            hint = f"install what it needs: pip install {missing or '<the missing package>'}"
        print(f"torchtune-pipe {command}: cannot import {module} ({e}); {hint}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``torchtune-pipe`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    doc = __doc__ or "torchtune-pipe"
    parser = argparse.ArgumentParser(prog="torchtune-pipe", description=doc.splitlines()[0])
    parser.add_argument(
        "command",
        choices=sorted(_COMMANDS),
        help="; ".join(f"{k}: {v[2]}" for k, v in _COMMANDS.items()),
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv[:1])
    module, func, _ = _COMMANDS[args.command]
    args_in = argv[1:] + rest
    if args.command == "demo":
        repo = _repo_demo()
        if repo is not None:
            print("torchtune-pipe demo: the repository's TorchRec DLRM example", flush=True)
            return int(repo.main(list(repo.DEMO_ARGS) + args_in) or 0)  # later flags win
    mod = _import(args.command, module)
    if mod is None:
        return 2
    return int(getattr(mod, func)(args_in) or 0)


if __name__ == "__main__":
    sys.exit(main())
