"""`ftjax data prepare`'s run: a corpus (ftjax/program/corpus.py) tokenized once (ftjax/program/tokenizer.py)
into the token files of ftjax/program/tokens.py, in chunks over a pool of processes, results
written in input order; the held-out split by a hash of each document's index; the output written
under a temporary name, under a lock, and renamed into place when complete.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from ftjax.program.corpus import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    Chunk,
    PrepareError,
    list_inputs,
    plan_chunks,
    read_documents,
    text_pieces,
)
from ftjax.program.tokenizer import bos_of, eos_of, load_tokenizer

if TYPE_CHECKING:
    from rich.progress import Progress
from ftjax.program.tokens import SPLITS, SplitWriter, token_dtype, write_index

# A longer document is encoded in pieces of this size (or of the chunk, if smaller): encoding one
# text, a tokenizer holds ~170 bytes a character at its peak; ~35 once it is encoded.
PIECE_CHARS = 1 << 16


_worker: dict = {}


def _init_worker(
    tokenizer_path: str, eos_id: int, field: str, bos_id: int | None = None, piece_chars: int = 1 << 20
) -> None:
    # The workers are the parallelism: the tokenizer's own threads would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _worker.update(tokenizer=tokenizer, eos_id=eos_id, field=field, bos_id=bos_id, piece_chars=piece_chars)


def encode_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of a chunk: each document's ids followed by EOS (and with `--bos` preceded
    by BOS), end to end (uint32), and each document's length with them (0 for an empty document,
    which is left out). A document longer than a chunk is encoded in pieces (`text_pieces`), so that
    memory stays bounded."""
    eos, limit, tokenizer = _worker["eos_id"], _worker["piece_chars"], _worker["tokenizer"]
    bos = _worker.get("bos_id")
    head = np.asarray([] if bos is None else [bos], np.uint32)
    texts = read_documents(chunk, _worker["field"])
    # No special tokens of the tokenizer's own (BOS, CLS): a document is its text, then EOS.
    short = [k for k, text in enumerate(texts) if len(text) <= limit]
    encoded = dict(zip(short, tokenizer.encode([texts[k] for k in short])))
    parts: list[np.ndarray] = []
    lengths = np.zeros(len(texts), np.int64)
    for k, text in enumerate(texts):
        if k in encoded:
            ids = np.asarray(encoded.pop(k), np.uint32)
        else:  # (a piece's encoding dropped before the next: a tokenizer keeps ~100x its text)
            ids = np.concatenate([np.asarray(tokenizer.encode([p])[0], np.uint32) for p in text_pieces(text, limit)])
        if len(ids):
            parts += [head, ids, np.asarray([eos], np.uint32)]
            lengths[k] = len(head) + len(ids) + 1
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint32)), lengths


# --- the held-out split ------------------------------------------------------------------------------


def heldout_mask(doc_index: np.ndarray, fraction: float) -> np.ndarray:
    """Which documents are held out: splitmix64 of the document's index in the input, as a uniform
    number in [0, 1), below `fraction`. A pure function of the index: any run, any worker count."""
    z = doc_index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)) < np.uint64(int(fraction * (1 << 53)))


# --- the whole run -----------------------------------------------------------------------------------


def prepare(
    inputs: list[str],
    tokenizer: str | Path,
    out: str | Path,
    *,
    field: str = "text",
    eos_token: str | None = None,
    bos_token: str | None = None,
    heldout_fraction: float = 0.01,
    workers: int | None = None,
    chunk_bytes: int = 1 << 20,
    force: bool = False,
    progress: bool = False,
    storage: str = "bin",
) -> dict:
    """Tokenize `inputs` into token files at `out`; returns the index with `seconds` (the wall time)."""
    t0 = time.perf_counter()
    if not 0 <= heldout_fraction < 1:
        raise PrepareError(f"--heldout-fraction: must be in [0, 1) (got {heldout_fraction})")
    out = Path(out)
    if out.exists() and not force:
        raise PrepareError(f"--out {out}: exists (--force replaces it)")
    tok = load_tokenizer(tokenizer)
    (eos_token, eos_id), bos = eos_of(tok, eos_token), bos_of(tok, bos_token)
    vocab_size, dtype, files = tok.vocab_size, token_dtype(tok.vocab_size), list_inputs(inputs)
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    lock = _claim(out, force)  # (held to the rename: a second run into `out` is refused, not interleaved)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writers = {split: SplitWriter(tmp, split, dtype, storage) for split in SPLITS}
        job = (str(tokenizer), eos_id, field, cast("int | None", bos.get("bos_id")), min(chunk_bytes, PIECE_CHARS))
        docs, empty = _tokenize(files, chunk_bytes, workers, job, vocab_size, heldout_fraction, writers, progress)
        splits = {split: w.close() for split, w in writers.items()}
        if splits["train"]["tokens"] == 0:
            raise PrepareError(f"no tokens in the train split ({docs} documents, {empty} empty)")
        index = write_index(
            tmp,
            {
                "dtype": dtype.name,
                "storage": storage,
                "vocab_size": vocab_size,
                "eos_id": eos_id,
                "eos_token": eos_token,
                **bos,
                "tokenizer": _tokenizer_record(tokenizer),
                "heldout_fraction": heldout_fraction,
                "documents": docs,
                "empty_documents": empty,
                "field": field if any(f.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES for f in files) else None,
                "inputs": list(inputs),
                "splits": splits,
            },
        )
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _release(out, lock)
    return {**index, "seconds": time.perf_counter() - t0}


def _tokenize(
    files: list[Path],
    chunk_bytes: int,
    workers: int,
    worker_args: tuple[str, int, str, int | None, int],
    vocab_size: int,
    fraction: float,
    writers: dict[str, SplitWriter],
    show: bool,
) -> tuple[int, int]:
    """Encode every chunk in the pool and write the results in input order; (documents, empty ones)."""
    bar = _progress_bar(show)
    task = bar.add_task("tokenize", total=sum(f.stat().st_size for f in files), tokens=0)
    chunks = plan_chunks(files, chunk_bytes, worker_args[2])
    docs = empty = tokens = 0
    # spawn: a worker starts clean (no copy of a parent's threads: rich's refresh, JAX in a benchmark)
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=worker_args,  # (tokenizer, eos_id, field, bos_id, piece_chars)
    )
    pending: collections.deque = collections.deque()
    try:
        with bar:
            while True:
                # A bounded window of chunks in flight, taken back in order: the output's order is
                # the input's, and memory stays a few chunks per worker however large the corpus.
                while len(pending) < 2 * workers and (chunk := next(chunks, None)) is not None:
                    pending.append((chunk, pool.submit(encode_chunk, chunk)))
                if not pending:
                    break
                chunk, future = pending.popleft()
                ids, lengths = future.result()
                if len(ids) and int(ids.max()) >= vocab_size:
                    raise PrepareError(
                        f"{chunk.paths[0]}: the tokenizer produced id {int(ids.max())}, outside its "
                        f"vocabulary of {vocab_size}"
                    )
                held = heldout_mask(np.arange(docs, docs + len(lengths)), fraction)
                rows = np.repeat(held, lengths)
                for split, keep, take in (("train", ~held, ~rows), ("heldout", held, rows)):
                    kept = lengths[keep & (lengths > 0)]
                    if len(kept):
                        writers[split].append(ids[take], kept)
                docs, empty, tokens = docs + len(lengths), empty + int((lengths == 0).sum()), tokens + len(ids)
                bar.update(task, advance=chunk.nbytes, tokens=tokens)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return docs, empty


def _progress_bar(show: bool) -> Progress:
    """The input read and the tokens written so far, on stderr when it is a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]tokenize"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
        console=console,
        disable=not (show and console.is_terminal),
    )


def _tokenizer_record(tokenizer: str | Path) -> dict:
    """The index's record of the tokenizer: its file name and the SHA-256 of its bytes."""
    return {"name": Path(tokenizer).name, "sha256": hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()}


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _claim(out: Path, force: bool) -> int:
    """An exclusive lock on `out` (flock of a lock file next to it, so a crashed run's lock goes with
    its process): a second `ftjax data prepare` into the same directory is refused while one runs,
    and `out` is checked again under the lock. Returns the lock's file descriptor."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = _lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PrepareError(
                f"--out {out}: another `ftjax data prepare` is writing it now ({path} is locked)"
            ) from None
        try:  # (the holder unlinks the file as it finishes: a lock on that old file claims nothing)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    if out.exists() and not force:  # (written by a run that finished since the first check)
        _release(out, fd)
        raise PrepareError(f"--out {out}: exists (--force replaces it)")
    return fd


def _release(out: Path, fd: int) -> None:
    """Unlink the lock file while still holding it (a run that opened it sees it gone, and retries)."""
    _lock_path(out).unlink(missing_ok=True)
    os.close(fd)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to `out` (replacing an old one only once the new one is whole)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
