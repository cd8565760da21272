"""A corpus as chunks of documents, read for `ftjax data prepare` (ftjax/program/prepare.py): plain
text files (a document each), JSON Lines files (a document per line, its text in a field) and
Parquet files (a document per row, its text in a string column). A chunk is what one worker
encodes: its documents follow from the files alone (a JSONL file cut at line ends, a Parquet file
between row groups), so the token files are the same bytes whatever the workers or the chunk size.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.parquet as pq

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


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


def plan_chunks(files: list[Path], chunk_bytes: int, field: str = "text") -> Iterator[Chunk]:
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


def _jsonl_cuts(path: Path, chunk_bytes: int, field: str) -> Iterator[Chunk]:
    total = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        while start < total:
            f.seek(start + chunk_bytes - 1)
            f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), total)
            yield Chunk((str(path),), jsonl=True, start=start, end=end, nbytes=end - start)
            start = end


def _parquet_cuts(path: Path, chunk_bytes: int, field: str) -> Iterator[Chunk]:
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


def _open_parquet(path: str | Path, field: str) -> pq.ParquetFile:
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
