"""The published-run files are JSON Lines: one object a line, blank lines skipped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def rows(path: Path) -> Iterator[dict]:
    for line in Path(path).read_text().splitlines():
        if line.strip():
            yield json.loads(line)
