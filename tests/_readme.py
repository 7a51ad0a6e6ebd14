"""The README's runnable snippets: each fenced Python block after ``<!-- readme-test: NAME -->``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- readme-test: (\S+) -->\n```python\n(.*?)```", re.S)


def snippets() -> dict[str, str]:
    """Snippet name -> its code."""
    return dict(_BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8")))
