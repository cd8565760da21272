"""A replica's memory while it reads a large token file: reading a 2 GiB uint16 token file end to
end through TokenWindows grows the reader's RSS by < 200 MB (windows are pread, not mapped pages).

The file is sparse (a hole of 2 GiB: zeros, nothing written) with a valid index; the reader is a
subprocess, so that its RSS is its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

GIB = 1 << 30
WINDOW = 2049  # (4098 bytes: consecutive windows touch every page of the file)

READER = textwrap.dedent(
    """
    import json, sys, time
    from ftjax.program.tokens import TokenWindows

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    src = TokenWindows(sys.argv[1], "train", int(sys.argv[2]), sys.argv[3])
    src[0]
    before, t0, checksum = rss_kib(), time.perf_counter(), 0
    for i in range(len(src)):
        w = src[i]
        checksum += int((w["tokens"] if isinstance(w, dict) else w)[-1])
    print(json.dumps({"windows": len(src), "before_kib": before, "after_kib": rss_kib(),
                      "seconds": time.perf_counter() - t0, "checksum": checksum}))
    """
)


def sparse_token_files(directory) -> None:
    """A train split of 2 GiB of token 0 (one document, no EOS), an empty heldout split, the index."""
    from ftjax.program.tokens import OFFSETS, SPLITS, TOKENS, write_index

    tokens = GIB  # (uint16: 2 GiB)
    splits = {}
    for split, n in zip(SPLITS, (tokens, 0)):
        (directory / split).mkdir()
        with open(directory / split / TOKENS, "wb") as f:
            f.truncate(2 * n)
        np.save(directory / split / OFFSETS, np.asarray([0, n], np.int64))
        splits[split] = {"tokens": n, "documents": 1, "sha256": "sparse", "offsets_sha256": "sparse"}
    record = {"name": "none", "sha256": "none"}
    write_index(directory, {"dtype": "uint16", "vocab_size": 256, "eos_id": 255, "tokenizer": record, "splits": splits})


@pytest.mark.timeout(360)
def test_reading_a_2_gib_token_file_end_to_end_grows_rss_by_less_than_200_mb(tmp_path):
    if shutil.disk_usage(tmp_path).free < 2 * GIB + (256 << 20):
        pytest.skip(f"{tmp_path}: less than 2 GiB free (the file is sparse, but a filesystem may not be)")
    sparse_token_files(tmp_path)
    assert os.path.getsize(tmp_path / "train" / "tokens.bin") == 2 * GIB
    done = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path), str(WINDOW), "none"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["windows"] == GIB // WINDOW and result["checksum"] == 0
    grown_mb = (result["after_kib"] - result["before_kib"]) * 1024 / 1e6
    assert grown_mb < 200, result


PREPARE = textwrap.dedent(
    """
    import resource, sys
    from ftjax.cli import prepare

    code = prepare.main(["prepare", *sys.argv[1:]])
    # (the largest of this process and its waited-for descendants: the pool's workers)
    print(max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    sys.exit(code)
    """
)


def _prepare_peak_mb(inputs: list[str], tokenizer: str, out) -> float:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PREPARE,
            *inputs,
            "--tokenizer",
            tokenizer,
            "--out",
            str(out),
            "--workers",
            "1",
            "--heldout-fraction",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.splitlines()[-1]) / 1e3


def test_one_large_document_is_tokenized_in_pieces_of_the_chunk_size(tmp_path):
    """6 MB of text as one document, and the same bytes as 1,500 documents: about the same peak
    memory (--chunk-mib 1: the document is encoded a piece of ~1 MiB at a time). Encoded whole, the
    one document took ~1 GB (a tokenizer keeps ~170 bytes a character of its encoding)."""
    from corpora import documents, train_tokenizer

    texts = documents(1500, seed=1)
    tokenizer = str(tmp_path / "tokenizer.json")
    train_tokenizer(texts[:300], tmp_path / "tokenizer.json")
    text = (" ".join(texts) + " ") * 40  # ~6 MB
    (tmp_path / "many").mkdir()
    step = -(-len(text) // 1500)
    for k in range(1500):
        (tmp_path / "many" / f"{k:04d}.txt").write_text(text[k * step : (k + 1) * step])
    (tmp_path / "one.txt").write_text(text)
    many = _prepare_peak_mb([str(tmp_path / "many")], tokenizer, tmp_path / "out_many")
    one = _prepare_peak_mb([str(tmp_path / "one.txt")], tokenizer, tmp_path / "out_one")
    assert one < many + 150, (one, many)
