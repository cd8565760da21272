"""The small parsers every part of the stack shares: a fault point (`STEP[:PHASE]`), JSON Lines
files, the job token."""

from __future__ import annotations

import pytest

from ftjax.base.env import read_token
from ftjax.runs.jsonl import parse_jsonl, read_jsonl
from ftjax.runtime.faults import parse_die_at, parse_step_phase


def test_parse_step_phase():
    assert parse_step_phase("7", "--die-at") == (7, "forward")
    assert parse_step_phase("7:commit", "--die-at") == (7, "commit")
    assert parse_die_at(None) is None and parse_die_at("") is None
    assert parse_die_at("3:ftar", "--hang-at") == (3, "ftar")
    for bad in ("0", "-1", "x", "3:nope", ":forward", "\u0663"):
        with pytest.raises(ValueError, match=r"^--hang-at: expected STEP\[:PHASE\]"):
            parse_die_at(bad, "--hang-at")


def test_jsonl_skips_torn_and_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []  # not written yet
    path.write_text('{"step": 1}\n\n{"step": 2, "event": "x"}\n{"step": 3, "lo')  # the writer was killed
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "event": "x"}]
    assert read_jsonl(str(path)) == read_jsonl(path)
    assert parse_jsonl([b'{"a": 1}', "", '{"b"']) == [{"a": 1}]


def test_read_token(tmp_path, monkeypatch):
    monkeypatch.setenv("FTJAX_TOKEN", " from-env\n")
    assert read_token() == "from-env"
    file = tmp_path / "token"
    file.write_text("from-file\n")
    assert read_token(str(file)) == "from-file"  # the file wins
    file.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(str(file))
    monkeypatch.delenv("FTJAX_TOKEN")
    with pytest.raises(ValueError, match=r"no job token: \$FTJAX_TOKEN is not set"):
        read_token()
