"""`ftjax data prepare` on Parquet files (ftjax/cli/prepare.py): documents from a string column, work
chunks cut between row groups. In-process, on a corpus made here (tests/corpora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from corpora import documents, train_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOKEN_FILES = ["heldout/offsets.npy", "heldout/tokens.bin", "train/offsets.npy", "train/tokens.bin"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """120 documents as one JSONL file and as one Parquet file of 7 row groups (text in `body`)."""
    root = tmp_path_factory.mktemp("parquet")
    texts = documents(120, seed=3)
    (root / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    table = pa.table({"id": list(range(len(texts))), "body": texts})
    pq.write_table(table, root / "docs.parquet", row_group_size=18)
    assert pq.ParquetFile(root / "docs.parquet").metadata.num_row_groups == 7
    train_tokenizer(texts, root / "tokenizer.json")
    return {"root": root, "texts": texts, "tokenizer": str(root / "tokenizer.json")}


def run(corpus, inputs: list[str], out: Path, **kw) -> dict:
    from ftjax.program.prepare import prepare

    return prepare(inputs, corpus["tokenizer"], out, field="body", heldout_fraction=0.2, **kw)


def test_parquet_gives_the_token_files_of_the_same_documents_as_jsonl_whatever_the_workers(corpus, tmp_path):
    root = corpus["root"]
    jsonl = run(corpus, [str(root / "docs.jsonl")], tmp_path / "jsonl", workers=1)
    # 1 worker, a chunk per row group; 2 workers, several row groups per chunk
    one = run(corpus, [str(root / "docs.parquet")], tmp_path / "pq1", workers=1, chunk_bytes=1)
    two = run(corpus, [str(root / "docs.parquet")], tmp_path / "pq2", workers=2, chunk_bytes=2048)
    assert jsonl["documents"] == one["documents"] == two["documents"] == len(corpus["texts"])
    assert jsonl["splits"]["heldout"]["documents"] > 0
    for f in TOKEN_FILES:
        want = (tmp_path / "jsonl" / f).read_bytes()
        assert (tmp_path / "pq1" / f).read_bytes() == want, f
        assert (tmp_path / "pq2" / f).read_bytes() == want, f
    assert jsonl["fingerprint"] == one["fingerprint"] == two["fingerprint"]
    assert one["field"] == "body"


def test_parquet_chunks_are_runs_of_whole_row_groups(corpus):
    from ftjax.program.corpus import plan_chunks

    path = corpus["root"] / "docs.parquet"
    for chunk_bytes in (1, 1500, 1 << 20):
        chunks = list(plan_chunks([path], chunk_bytes, "body"))
        assert all(c.parquet for c in chunks)
        assert all(a.end == b.start < b.end for a, b in zip(chunks, chunks[1:]))  # contiguous, none empty
        assert chunks[0].start == 0 and chunks[-1].end == 7
    assert len(list(plan_chunks([path], 1, "body"))) == 7
    assert len(list(plan_chunks([path], 1 << 20, "body"))) == 1


def test_a_missing_or_non_string_column_exits_2_naming_file_and_column(corpus, tmp_path, capsys):
    from ftjax.cli import prepare

    path = corpus["root"] / "docs.parquet"
    argv = ["prepare", str(path), "--tokenizer", corpus["tokenizer"], "--workers", "1"]
    assert prepare.main([*argv, "--field", "text", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: no column 'text'" in err and "'body'" in err and "Traceback" not in err
    assert prepare.main([*argv, "--field", "id", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: column 'id' (--field) is of type int64, not a string" in err
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"body": ["one", "two", None]}), nulls, row_group_size=2)
    assert prepare.main(["prepare", str(nulls), *argv[2:], "--field", "body", "--out", str(tmp_path / "c")]) == 2
    assert f"{nulls}: row 2: column 'body' (--field) is null" in capsys.readouterr().err
    assert not list(tmp_path.glob("[abc]")) and not list(tmp_path.glob(".*")), "partial output left behind"
