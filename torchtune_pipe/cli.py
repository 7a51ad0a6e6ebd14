"""The ``torchtune-pipe`` command: demo, bench, simulate, pretrain.

Each subcommand forwards its remaining arguments to the module that implements it, so
``torchtune-pipe simulate --help`` shows that module's own options.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, function, help)
_COMMANDS = {
    "demo": ("examples.dlrm.train", "demo", "train the DLRM example on generated Criteo data, tuned (about two minutes)"),
    "train": ("examples.dlrm.train", "main", "the DLRM example with all its options"),
    "bench": ("benchmarks.executor", "main", "executor benchmark: channel bandwidth, tiny items, efficiency, start latency"),
    "simulate": ("torchtune_pipe.sim.studies", "main", "the InTune paper's studies in the simulator (JSON + PNG)"),
    "pretrain": ("torchtune_pipe.sim.pretrain", "main", "pre-train the InTune agent in the simulator"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``torchtune-pipe`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="torchtune-pipe", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v[2]}" for k, v in _COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv[:1])
    module, func, _ = _COMMANDS[args.command]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"torchtune-pipe {args.command}: cannot import {module} ({e}); run from the repository root "
              f"after `make install`", file=sys.stderr)
        return 2
    result = getattr(mod, func)(argv[1:] + rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
