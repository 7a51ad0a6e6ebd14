"""The data ``benchmarks/peers.py`` reads, prepared in a child process.

``python -m benchmarks._peers_data DATA_DIR FILES ROWS CRITEO`` writes the synthetic Criteo
files (when ``CRITEO`` is 1) and prints ``{"paths": [...], "table_sizes": [...]}`` as its last
line. The harness itself imports neither torch nor numpy: PSS splits a page among every
process that maps it, the harness included, so a harness that mapped torch's libraries took
half of those pages from a one-process tool's tree and a fifth from a four-process tree's,
and the trees' PSS compared unequally (torchdata.nodes' one process in ``remote-map``: 200 MiB
beside a harness that had imported torch, 232 MiB alone).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from benchmarks.peers import ensure_data
    from examples.dlrm.criteo import DEFAULT_TABLE_SIZES

    data_dir, files, rows, criteo = argv[0], int(argv[1]), int(argv[2]), argv[3] == "1"
    paths = ensure_data(data_dir, files, rows) if criteo else []
    print(json.dumps({"paths": paths, "table_sizes": list(DEFAULT_TABLE_SIZES)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
