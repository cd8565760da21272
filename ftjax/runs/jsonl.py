"""JSON Lines files (metrics.jsonl, launcher.jsonl), read while or after another process appends to
them: a line torn by a SIGKILL mid-write, or not yet finished, is skipped, never an error."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def parse_jsonl(lines: Iterable[str | bytes]) -> list[dict]:
    """The JSON objects of `lines` (blank and torn lines skipped)."""
    out = []
    for line in lines:
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # torn by a SIGKILL mid-write: that process is gone anyway
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Every complete JSON line of a file; [] if there is no such file."""
    try:
        with open(path, "rb") as f:
            return parse_jsonl(f)
    except FileNotFoundError:
        return []
