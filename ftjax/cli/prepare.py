"""`ftjax data prepare INPUT... --tokenizer tokenizer.json --out DIR`: tokenize a corpus once.

Inputs are plain text files (one document per file; a directory or a glob stands for the files
under it, in sorted order), JSON Lines files (`.jsonl`, `.ndjson`: one document per line, its
text in `--field`) and Parquet files (`.parquet`: one document per row, its text in the string
column `--field`). The tokenizer is a local file, nothing is downloaded: a Hugging Face
`tokenizer.json` (a `.json` file), else a SentencePiece model (`tokenizer.model`, `spm.model`).
Each document is followed by the EOS token. `--format array_record` stores each split as an
ArrayRecord file of one record per document instead of a flat tokens.bin (the same tokens, the same
fingerprint). Documents are split between `train` and `heldout` by a hash of their index in the
input (`--heldout-fraction`), so the split does not depend on anything but the input's order.
Output: the token files of ftjax/program/tokens.py, written under a temporary name and renamed
into place when complete, so a crashed run never leaves something that looks done.

The work is spread over processes (`--workers`, default: every core) in chunks of documents
(`--chunk-mib` of input each; a Parquet file is cut between row groups); results are written in
input order, so the files are the same bytes whatever the number of workers or the chunk size.
A document longer than a chunk (or than PIECE_CHARS) is encoded a piece at a time, cut before a space
between words (`text_pieces` says for which tokenizers the tokens are the same), so memory stays
bounded however long one document is.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import glob
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftjax.program.tokens import SPLITS, STORAGES, SplitWriter, TokenFileError, token_dtype, write_index

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_EOS = ("</s>", "<|endoftext|>")
# A longer document is encoded in pieces of this size (or of the chunk, if smaller): encoding one
# text, a tokenizer holds ~170 bytes a character at its peak; ~35 once it is encoded.
PIECE_CHARS = 1 << 16


class PrepareError(ValueError):
    """Input that cannot be prepared: the message names the file (path:line) or flag at fault."""


# --- the input, as chunks of documents ---------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Documents for one worker: whole text files (one document each), the lines of a JSONL
    file's byte range [start, end) (both on line boundaries), or the rows of a Parquet file's row
    groups [start, end)."""

    paths: tuple[str, ...]
    jsonl: bool = False
    parquet: bool = False
    start: int = 0
    end: int = 0
    nbytes: int = 0


def list_inputs(inputs: list[str]) -> list[Path]:
    """The files that INPUT arguments name, in order: a file; a directory's files (recursively,
    sorted, hidden ones left out); a glob's matches (sorted)."""
    files: list[Path] = []
    for arg in inputs:
        path = Path(arg)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        else:
            matches = sorted(Path(m) for m in glob.glob(arg, recursive=True) if Path(m).is_file())
            if not matches:
                raise PrepareError(f"{arg}: no such file or directory, and no file matches it as a glob")
            files += matches
    if not files:
        raise PrepareError(f"no input files in {' '.join(inputs)}")
    for path in files:  # (read as text, a JSON file would be one document of its braces and quotes)
        if path.suffix == ".json":
            raise PrepareError(
                f"{path}: a .json input is read neither as text nor as JSON Lines: name it .jsonl (or .ndjson) "
                "if it holds one JSON object per line"
            )
    return files


def plan_chunks(files: list[Path], chunk_bytes: int, field: str = "text"):
    """Chunks of about `chunk_bytes` of input each, in input order. A JSONL file is cut at line
    ends found by seeking (the file is not read here), a Parquet file between row groups (its
    footer is read, and its `field` column checked); text files are grouped whole."""
    group: list[Path] = []
    size = 0
    for path in files:
        if path.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES:
            if group:
                yield Chunk(tuple(map(str, group)), nbytes=size)
                group, size = [], 0
            cuts = _jsonl_cuts if path.suffix in JSONL_SUFFIXES else _parquet_cuts
            yield from cuts(path, chunk_bytes, field)
        else:
            group.append(path)
            size += path.stat().st_size
            if size >= chunk_bytes:
                yield Chunk(tuple(map(str, group)), nbytes=size)
                group, size = [], 0
    if group:
        yield Chunk(tuple(map(str, group)), nbytes=size)


def _jsonl_cuts(path: Path, chunk_bytes: int, field: str):
    total = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        while start < total:
            f.seek(start + chunk_bytes - 1)
            f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), total)
            yield Chunk((str(path),), jsonl=True, start=start, end=end, nbytes=end - start)
            start = end


def _parquet_cuts(path: Path, chunk_bytes: int, field: str):
    """Runs of whole row groups of about `chunk_bytes` (compressed) each. A row group is the
    smallest unit Parquet reads on its own, so it is the cut: which rows a chunk holds follows from
    the file alone, and the output is the same bytes whatever the workers or the chunk size."""
    meta = _open_parquet(path, field).metadata
    start, size = 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        size += sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        if size >= chunk_bytes or g == meta.num_row_groups - 1:
            yield Chunk((str(path),), parquet=True, start=start, end=g + 1, nbytes=size)
            start, size = g + 1, 0


def _open_parquet(path: str | Path, field: str):
    """The Parquet file at `path`, its `field` column checked: present, and of strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise PrepareError(f"{path}: not a Parquet file: {e}") from None
    schema = f.schema_arrow
    if field not in schema.names:
        raise PrepareError(
            f"{path}: no column {field!r} (--field; this file has {', '.join(map(repr, schema.names)) or 'no columns'})"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise PrepareError(f"{path}: column {field!r} (--field) is of type {kind}, not a string")
    return f


def _parquet_documents(chunk: Chunk, field: str) -> list[str]:
    """The texts of a Parquet chunk's row groups, in row order (a null is an error: no document)."""
    path = chunk.paths[0]
    import pyarrow as pa

    f = _open_parquet(path, field)
    try:
        texts = f.read_row_groups(range(chunk.start, chunk.end), columns=[field])[field].to_pylist()
    except (OSError, pa.ArrowException) as e:
        raise PrepareError(f"{path}: {e}") from None
    if None in texts:
        row = sum(f.metadata.row_group(g).num_rows for g in range(chunk.start)) + texts.index(None)
        raise PrepareError(f"{path}: row {row}: column {field!r} (--field) is null, not a string")
    return texts


# --- a worker ----------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(
    tokenizer_path: str, eos_id: int, field: str, bos_id: int | None = None, piece_chars: int = 1 << 20
) -> None:
    # The workers are the parallelism: the tokenizer's own threads would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _worker.update(tokenizer=tokenizer, eos_id=eos_id, field=field, bos_id=bos_id, piece_chars=piece_chars)


def _line_number(path: str, offset: int) -> int:
    """The line (1-based) that starts at byte `offset` of a file: counted only for an error message."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def read_documents(chunk: Chunk, field: str) -> list[str]:
    """The texts of a chunk's documents, in order (an empty document stays, as "")."""
    if chunk.parquet:
        return _parquet_documents(chunk, field)
    if not chunk.jsonl:
        texts = []
        for path in chunk.paths:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise PrepareError(f"{path}: {e.strerror}") from None
            try:
                texts.append(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        return texts
    path = chunk.paths[0]
    try:
        with open(path, "rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.end - chunk.start)
    except OSError as e:
        raise PrepareError(f"{path}: {e.strerror}") from None
    texts, pos = [], chunk.start
    for line in data.split(b"\n"):
        where, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue  # (a blank line, the file's final newline: no document)
        try:
            record = json.loads(line)
        except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError both)
            raise PrepareError(f"{path}:{_line_number(path, where)}: not a JSON line: {e}") from None
        if not isinstance(record, dict):
            raise PrepareError(
                f"{path}:{_line_number(path, where)}: a JSON {type(record).__name__}, not an "
                f"object with a {field!r} field"
            )
        if field not in record:
            raise PrepareError(
                f"{path}:{_line_number(path, where)}: no field {field!r} (--field; this line has "
                f"{', '.join(map(repr, record)) or 'no fields'})"
            )
        if not isinstance(record[field], str):
            raise PrepareError(
                f"{path}:{_line_number(path, where)}: field {field!r} is a {type(record[field]).__name__}, not a string"
            )
        if b"\\ud" in line.lower():  # (only a \uD800-\uDFFF escape can make a lone surrogate)
            _check_surrogates(record[field], path, where, field)
        texts.append(record[field])
    return texts


def _check_surrogates(text: str, path: str, where: int, field: str) -> None:
    """Refuse a text with a lone surrogate (an escape like \\udcff without its pair): it is not
    Unicode, so no tokenizer encodes it; replacing it would change the corpus behind the user's back
    (text files that are not UTF-8 are refused alike)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PrepareError(
            f"{path}:{_line_number(path, where)}: field {field!r} holds a lone surrogate "
            f"(\\u{ord(text[e.start]):04x} at character {e.start}), not Unicode text: fix the line's escapes"
        ) from None


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


_CUT = re.compile(r"(?<=\S)(?= \S)")


def text_pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of at least `size` characters (the last one: the rest), each cut just
    before a space between two non-space characters. Tokenizers pre-split a text there (a word
    and the space before the next: byte-level BPE, GPT-2's or Llama 3's; Metaspace; SentencePiece
    models that remove extra whitespace), so the pieces' tokens, end to end, are the text's. A model
    that prepends a marker to each text it encodes and keeps whitespace (Llama 2's SentencePiece)
    gets one at each cut: a different token or two per `size` characters of a long document. A text
    with no such space after `size` characters stays one piece."""
    pieces, start = [], 0
    while len(text) - start > size and (cut := _CUT.search(text, start + size)) is not None:
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


# --- the held-out split ------------------------------------------------------------------------------


def heldout_mask(doc_index: np.ndarray, fraction: float) -> np.ndarray:
    """Which documents are held out: splitmix64 of the document's index in the input, as a uniform
    number in [0, 1), below `fraction`. A pure function of the index: any run, any worker count."""
    z = doc_index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)) < np.uint64(int(fraction * (1 << 53)))


# --- the tokenizer -----------------------------------------------------------------------------------


class HFTokenizer:
    """A Hugging Face tokenizer.json: ids of texts, the id of a token, the vocabulary size."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # (the Rust side raises plain Exception)
            raise PrepareError(f"--tokenizer {path}: not a Hugging Face tokenizer.json: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


class SentencePieceTokenizer:
    """A SentencePiece model file (`.model`: its serialized ModelProto), the same interface."""

    def __init__(self, path: str | Path):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise PrepareError(f"--tokenizer {path}: not a SentencePiece model: {e}") from None
        self.vocab_size = self.sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        """The piece's id, None when the model has no such piece (piece_to_id answers unk's id)."""
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        # No BOS or EOS of the model's own; one thread (the workers are the parallelism)
        return self.sp.encode(texts, out_type=int, add_bos=False, add_eos=False, num_threads=1)


def load_tokenizer(path: str | Path) -> HFTokenizer | SentencePieceTokenizer:
    """A `.json` file is a Hugging Face tokenizer.json; anything else, a SentencePiece model."""
    if not Path(path).is_file():
        raise PrepareError(f"--tokenizer {path}: no such file (a tokenizer.json or a SentencePiece .model)")
    return HFTokenizer(path) if Path(path).suffix == ".json" else SentencePieceTokenizer(path)


def bos_of(tokenizer, bos_token: str | None) -> dict:
    """The index's record of `--bos`: {bos_id, bos_token}, or {} without it (recorded only when set:
    an index without BOS keeps the fingerprint it had)."""
    if bos_token is None:
        return {}
    bos_id = tokenizer.token_to_id(bos_token)
    if bos_id is None:
        raise PrepareError(f"--bos {bos_token!r}: not a token of the tokenizer")
    return {"bos_id": bos_id, "bos_token": bos_token}


def eos_of(tokenizer, eos_token: str | None) -> tuple[str, int]:
    """(EOS token, its id): `--eos-token`, else the first of DEFAULT_EOS the tokenizer has."""
    for token in [eos_token] if eos_token is not None else DEFAULT_EOS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    if eos_token is not None:
        raise PrepareError(f"--eos-token {eos_token!r}: not a token of the tokenizer")
    raise PrepareError(
        f"the tokenizer has none of {', '.join(DEFAULT_EOS)}: name its end-of-document token with --eos-token"
    )


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
        job = (str(tokenizer), eos_id, field, bos.get("bos_id"), min(chunk_bytes, PIECE_CHARS))
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


def _tokenize(files, chunk_bytes, workers, worker_args, vocab_size, fraction, writers, show):
    """Encode every chunk in the pool and write the results in input order; (documents, empty ones)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("[bold]tokenize"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
        console=console,
        disable=not (show and console.is_terminal),
    )
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


# --- the command -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftjax data prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories, globs, .jsonl, .parquet files")
    p.add_argument(
        "--tokenizer", required=True, help="a Hugging Face tokenizer.json, or a SentencePiece model file (.model)"
    )
    p.add_argument("--out", required=True, help="the token files' directory (written whole, or not at all)")
    p.add_argument("--field", default="text", help="JSONL field or Parquet column holding a document's text (text)")
    p.add_argument(
        "--eos-token",
        default=None,
        help=f"the token after each document (default: {' or '.join(DEFAULT_EOS)}, the first the tokenizer has)",
    )
    p.add_argument(
        "--bos",
        default=None,
        metavar="TOKEN",
        help="a token before each document, e.g. '<|begin_of_text|>' (Llama 3), '<s>'; default: none",
    )
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.01,
        help="fraction of the documents in the heldout split, chosen by a hash of their index (0.01)",
    )
    p.add_argument("--workers", type=int, default=None, help="processes (default: this machine's cores)")
    p.add_argument("--chunk-mib", type=float, default=1.0, help="input per work item, MiB (1)")
    p.add_argument(
        "--format",
        choices=STORAGES,
        default="bin",
        help="bin: a flat tokens.bin per split (default); array_record: an ArrayRecord file, a record per document",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def main(argv: list[str]) -> int:
    """`ftjax data SUBCOMMAND`: only `prepare` for now."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: ftjax data prepare INPUT... --tokenizer tokenizer.json|spm.model --out DIR\n\n"
            "  prepare      tokenize a corpus once into token files (`ftjax data prepare --help`)"
        )
        return 0 if argv else 2
    if argv[0] != "prepare":
        print(f"ftjax data: unknown subcommand {argv[0]!r} (prepare)", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv[1:])
    if args.workers is not None and args.workers < 1:
        print(f"ftjax data prepare: error: --workers: must be >= 1 (got {args.workers})", file=sys.stderr)
        return 2
    if not args.chunk_mib > 0:
        print(f"ftjax data prepare: error: --chunk-mib: must be > 0 (got {args.chunk_mib})", file=sys.stderr)
        return 2
    try:
        index = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            field=args.field,
            eos_token=args.eos_token,
            bos_token=args.bos,
            heldout_fraction=args.heldout_fraction,
            workers=args.workers,
            chunk_bytes=max(1, int(args.chunk_mib * (1 << 20))),
            force=args.force,
            progress=True,
            storage=args.format,
        )
    except (PrepareError, TokenFileError) as e:
        print(f"ftjax data prepare: error: {e}", file=sys.stderr)
        return 2
    train, held = index["splits"]["train"], index["splits"]["heldout"]
    total = train["tokens"] + held["tokens"]
    print(
        f"ftjax data prepare: {args.out}: {_documents(index['documents'])}, {total:,} tokens ({index['dtype']}, "
        f"EOS {index['eos_token']!r} = {index['eos_id']}); train {_documents(train['documents'])} / "
        f"{train['tokens']:,} tokens, heldout {held['documents']:,} / {held['tokens']:,}; "
        f"{total / index['seconds']:,.0f} tokens/s; fingerprint {index['fingerprint']}"
    )
    return 0


def _documents(n: int) -> str:
    return f"{n:,} document" + ("" if n == 1 else "s")
