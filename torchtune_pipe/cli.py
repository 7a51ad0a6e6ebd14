"""The ``torchtune-pipe`` command: demo, train, bench, peers, simulate, pretrain.

Each subcommand forwards its remaining arguments to the module that implements it, so
``torchtune-pipe simulate --help`` shows that module's own options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, function, help)
_COMMANDS = {
    "demo": (
        "examples.dlrm.train",
        "main",
        "train the DLRM example on generated Criteo data, tuned (about two minutes)",
    ),
    "train": ("examples.dlrm.train", "main", "the DLRM example with all its options"),
    "bench": (
        "benchmarks.executor",
        "main",
        "executor benchmark: channel bandwidth, tiny items, efficiency, start latency",
    ),
    "peers": (
        "benchmarks.peers",
        "main",
        "the same Criteo pipeline through DataLoader, torchdata.nodes, SPDL and every tuner",
    ),
    "simulate": (
        "torchtune_pipe.sim.studies",
        "main",
        "the InTune paper's studies in the simulator (JSON + PNG)",
    ),
    "pretrain": (
        "torchtune_pipe.sim.pretrain",
        "main",
        "pre-train the InTune agent in the simulator",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``torchtune-pipe`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="torchtune-pipe", description=__doc__.splitlines()[0])
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
    if not module.startswith("torchtune_pipe") and os.getcwd() not in sys.path:
        # examples/ and benchmarks/ live in the repository, not in the installed package.
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(
            f"torchtune-pipe {args.command}: cannot import {module} ({e}); run from the repository root "
            f"after `make install`",
            file=sys.stderr,
        )
        return 2
    args_in = argv[1:] + rest
    if args.command == "demo":
        args_in = list(mod.DEMO_ARGS) + args_in  # later flags override the demo's
    result = getattr(mod, func)(args_in)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
