"""Token files: a tokenized corpus on disk, read through a memory map (docs/design/data.md, "Token files").

`ftjax data prepare` (ftjax/program/prepare.py) writes a directory:

    DIR/index.json            what the files hold (below); its `fingerprint` names their content
    DIR/train/tokens.bin      every token of the split, documents end to end, each followed by EOS
    DIR/train/offsets.npy     int64[documents + 1]: where each document starts, then the token count
    DIR/heldout/...           the same for the held-out documents

Tokens are uint16 when the vocabulary fits, else uint32, little-endian, no header: a flat array any
tool can map. `open_tokens` maps the file (`np.memmap`); TokenWindows reads each window with one
`os.pread` instead, so the pages it has read stay in the kernel's page cache (shared, reclaimable)
and never count in the replica's resident memory: reading a 2 GiB file end to end grows a reader's
RSS by a few MB (tests/integration/test_token_rss.py), where a map it indexes grows by 2 GiB.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

FORMAT = "ftjax-tokens-v1"
INDEX = "index.json"
SPLITS = ("train", "heldout")
TOKENS = "tokens.bin"
OFFSETS = "offsets.npy"
ARRAY_RECORD = "tokens.array_record"
STORAGES = ("bin", "array_record")  # the index's `storage` (absent: bin)
ARRAY_RECORD_WRITE = "group_size:1,uncompressed"  # (a document per chunk: one read per record)
ARRAY_RECORD_READ = "readahead_buffer_size:0,max_parallelism:0"  # (random access)


if TYPE_CHECKING:
    from array_record.python.array_record_module import ArrayRecordWriter


class TokenFileError(ValueError):
    """Token files that cannot be read: the message names the file (and the key) at fault."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of a vocabulary: uint16, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _dtype(directory: Path, index: dict) -> np.dtype:
    if index["dtype"] not in ("uint16", "uint32"):
        raise TokenFileError(f"{directory / INDEX}: dtype: expected uint16 or uint32, got {index['dtype']!r}")
    return np.dtype(index["dtype"]).newbyteorder("<")  # (the files are little-endian on any machine)


def read_index(directory: str | Path) -> dict:
    """DIR/index.json, checked for what a reader needs."""
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise TokenFileError(
            f"{path}: no such file (is {directory} a directory written by `ftjax data prepare`?)"
        ) from None
    except (OSError, ValueError) as e:
        raise TokenFileError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise TokenFileError(
            f"{path}: format: expected {FORMAT!r}, got {index.get('format') if isinstance(index, dict) else index!r}"
        )
    for key in ("dtype", "vocab_size", "eos_id", "fingerprint", "splits"):
        if key not in index:
            raise TokenFileError(f"{path}: {key}: missing")
    return index


def _split_info(directory: Path, index: dict, split: str) -> dict:
    info = index["splits"].get(split)
    if info is None:
        raise TokenFileError(f"{directory / INDEX}: splits: no split {split!r} (has {sorted(index['splits'])})")
    return info


def open_tokens(directory: str | Path, split: str, index: dict | None = None) -> np.ndarray:
    """The tokens of one split, memory-mapped read-only (nothing is read until it is indexed)."""
    directory = Path(directory)
    index = index if index is not None else read_index(directory)
    info, dtype = _split_info(directory, index, split), _dtype(directory, index)
    path = directory / split / TOKENS
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise TokenFileError(f"{path}: no such file") from None
    if size != info["tokens"] * dtype.itemsize:
        raise TokenFileError(
            f"{path}: {size} bytes, but {INDEX} says {info['tokens']} tokens of {dtype} "
            f"({info['tokens'] * dtype.itemsize} bytes): truncated or not this index's file"
        )
    if size == 0:  # (mmap cannot map an empty file)
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def check_offsets(directory: str | Path, index: dict, split: str) -> None:
    """Hash a split's offsets.npy against the `offsets_sha256` of the index (8 bytes a document: cheap)
    and check their bounds. Raises TokenFileError naming the file."""
    directory = Path(directory)
    info, path = _split_info(directory, index, split), directory / split / OFFSETS
    try:
        offsets = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise TokenFileError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise TokenFileError(f"{path}: not a .npy array: {e}") from None
    recorded = info.get("offsets_sha256")
    digest = hashlib.sha256(np.ascontiguousarray(offsets, "<i8").tobytes()).hexdigest()
    if recorded is not None and (offsets.dtype.kind != "i" or digest != recorded):
        raise TokenFileError(
            f"{path}: does not hash to the offsets_sha256 that {directory / INDEX} recorded "
            f"({str(recorded)[:12]}...): the file changed after `ftjax data prepare` (prepare them again)"
        )
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != info["tokens"]:
        raise TokenFileError(
            f"{path}: not int64[documents + 1] from 0 to the {info['tokens']} tokens that {directory / INDEX} says"
        )


PACKINGS = ("none", "segments")


def segment_ids(window: np.ndarray, eos_id: int) -> np.ndarray:
    """int32 document numbers of a window's tokens, from 0: a document's EOS is its last token, so
    the id steps up on the token after each EOS."""
    ends = np.asarray(window) == eos_id
    return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)


class TokenWindows:
    """Random-access source of non-overlapping `window`-token windows of one split (int32 arrays).

    Window i is tokens [i * window, (i + 1) * window): documents run across windows, separated by
    EOS (the tail shorter than a window is left out). Only the indexed window is read from disk
    (one pread, not through the map: module docstring), and pickling (a grain worker, a copy of the
    task) reopens the files instead of copying tokens.
    `packing="segments"`: an example is a dict of the window's `tokens` and `segment_ids` (its
    documents numbered from 0 by the index's EOS id, `segment_ids`), so that a model attends, and a
    loss trains, within a document only.
    """

    def __init__(self, directory: str | Path, split: str = "train", window: int = 65, packing: str = "none"):
        if window < 1:
            raise TokenFileError(f"window: must be >= 1 (got {window})")
        if packing not in PACKINGS:
            raise TokenFileError(f"packing: expected one of {', '.join(PACKINGS)}, got {packing!r}")
        self.directory, self.split, self.window, self.packing = Path(directory), split, int(window), packing
        self.index = read_index(self.directory)
        self.vocab_size, self.eos_id = int(self.index["vocab_size"]), int(self.index["eos_id"])
        self.storage = self.index.get("storage", "bin")
        self.dtype, self.count = (
            _dtype(self.directory, self.index),
            int(_split_info(self.directory, self.index, split)["tokens"]),
        )
        self.tokens: np.ndarray | None = None  # (array_record: read by records)
        if self.storage == "bin":
            self.tokens = open_tokens(self.directory, split, self.index)  # (checked; windows are read apart)
        elif self.storage == "array_record":
            if not (self.directory / split / ARRAY_RECORD).is_file():
                raise TokenFileError(f"{self.directory / split / ARRAY_RECORD}: no such file")
            # (the records of a window are found through the offsets: damaged ones read other tokens)
            check_offsets(self.directory, self.index, split)
        else:
            raise TokenFileError(f"{self.directory / INDEX}: storage: expected one of {STORAGES}, got {self.storage!r}")
        self.n = self.count // self.window
        self._fd: int | None = None
        self._pid = -1
        self._records: ArrayRecordTokens | None = None
        # Same content, split, window and packing: same examples, whatever the directory is called.
        packed = "" if packing == "none" else f"-{packing}"
        self.fingerprint = f"{self.index['fingerprint']}-{split}-w{self.window}{packed}"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray | dict:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range: {self.split} has {self.n} windows of {self.window} tokens")
        tokens = self._read(i * self.window, self.window).astype(np.int32)
        if int(tokens.max()) >= self.vocab_size:  # (an embedding lookup past the table is NaN, silently)
            at = int(np.argmax(tokens >= self.vocab_size))
            raise TokenFileError(
                f"{self.directory / self.split}: token {i * self.window + at} (window {i}) is "
                f"{int(tokens[at])}, not below the vocabulary of {self.directory / INDEX} "
                f"(vocab_size {self.vocab_size}): the files changed after `ftjax data prepare`, or are "
                "not this index's"
            )
        if self.packing == "none":
            return tokens
        return {"tokens": tokens, "segment_ids": segment_ids(tokens, self.eos_id)}

    def verify(self) -> None:
        """Hash this split's tokens against the sha256 `ftjax data prepare` recorded in the index (the
        whole split, read once: `ftjax check` calls it; training reads windows only and checks each
        one's ids against the vocabulary). Raises TokenFileError naming the file."""
        h, step = hashlib.sha256(), 1 << 24
        for start in range(0, self.count, step):
            h.update(self._read(start, min(step, self.count - start)).tobytes())
        check_offsets(self.directory, self.index, self.split)
        recorded = _split_info(self.directory, self.index, self.split)["sha256"]
        if h.hexdigest() != recorded:
            raise TokenFileError(
                f"{self.directory / self.split}: its {self.count:,} tokens do not hash to the sha256 that "
                f"{self.directory / INDEX} recorded ({recorded[:12]}...): the files changed after "
                "`ftjax data prepare` (prepare them again)"
            )

    def _read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count): one pread of tokens.bin, or the ArrayRecord records (one a
        document) that hold them. The files are opened once per process (a forked worker opens its own)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            if self.storage == "bin":
                self._fd = os.open(self.directory / self.split / TOKENS, os.O_RDONLY)
            else:
                self._records = ArrayRecordTokens(self.directory / self.split, self.dtype)
        if self._records is not None:
            return self._records.read(start, count)
        size = self.dtype.itemsize
        assert self._fd is not None  # (opened above for bin storage)
        data = os.pread(self._fd, count * size, start * size)
        if len(data) != count * size:
            raise TokenFileError(f"{self.directory / self.split / TOKENS}: short read at token {start} (truncated?)")
        return np.frombuffer(data, self.dtype)

    def __del__(self, _getpid=os.getpid, _close=os.close) -> None:
        # (bound at definition: at interpreter exit the module's `os` may already be None)
        if getattr(self, "_fd", None) is not None and self._pid == _getpid():
            _close(self._fd)

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "split": self.split, "window": self.window, "packing": self.packing}

    def __setstate__(self, state: dict) -> None:
        TokenWindows.__init__(self, state["directory"], state["split"], state["window"], state.get("packing", "none"))


class ArrayRecordTokens:
    """A split stored as an ArrayRecord file (`--format array_record`): record k is document k's
    tokens (with its EOS), read by record index through array_record's random access; offsets.npy
    (memory-mapped) says which records hold a range of tokens."""

    def __init__(self, path: Path, dtype: np.dtype):
        from array_record.python.array_record_module import ArrayRecordReader

        self.path, self.dtype = path / ARRAY_RECORD, dtype
        self.reader = ArrayRecordReader(str(self.path), ARRAY_RECORD_READ)
        self.offsets = np.load(path / OFFSETS, mmap_mode="r")

    def read(self, start: int, count: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, start + count, side="left"))  # (records first..last - 1)
        data = b"".join(self.reader.read(list(range(first, last))))
        skip = start - int(self.offsets[first])
        tokens = np.frombuffer(data, self.dtype)[skip : skip + count]
        if len(tokens) != count:
            raise TokenFileError(
                f"{self.path}: records {first}..{last - 1} hold too few tokens (not this index's file?)"
            )
        return tokens


# --- writing (ftjax/program/prepare.py) ---------------------------------------------------------------------


class SplitWriter:
    """Appends documents (tokens already followed by EOS) to one split's files, hashing as it goes."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, storage: str = "bin"):
        self.path = directory / split
        self.path.mkdir(parents=True)
        self.dtype = dtype
        self._file: BinaryIO | None = None
        self._records: ArrayRecordWriter | None = None
        if storage == "bin":
            self._file = open(self.path / TOKENS, "wb")
        else:
            from array_record.python.array_record_module import ArrayRecordWriter

            self._records = ArrayRecordWriter(str(self.path / ARRAY_RECORD), ARRAY_RECORD_WRITE)
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.tokens = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents whose tokens are `tokens`, `lengths[k]` tokens each, in order."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        if self._file is not None:
            self._file.write(data)
        else:  # a record per document
            assert self._records is not None
            bounds = np.concatenate([[0], np.cumsum(lengths)]) * self.dtype.itemsize
            for a, b in zip(bounds[:-1], bounds[1:]):
                self._records.write(data[a:b])
        self._sha.update(data)  # (the same hash in either storage: the tokens')
        self._lengths.append(np.asarray(lengths, np.int64))
        self.tokens += len(tokens)

    def close(self) -> dict:
        """Write the offsets; this split's entry of the index. Both files are on disk when it returns
        (fsync: the directory is renamed into place next, and must not look finished before it is)."""
        if self._file is not None:
            _sync_close(self._file)
        else:
            assert self._records is not None
            self._records.close()
            with open(self.path / ARRAY_RECORD, "rb") as f:
                os.fsync(f.fileno())
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        with open(self.path / OFFSETS, "wb") as f:
            np.save(f, offsets)
            _sync_close(f)
        return {
            "tokens": self.tokens,
            "documents": len(lengths),
            "sha256": self._sha.hexdigest(),
            "offsets_sha256": hashlib.sha256(offsets.tobytes()).hexdigest(),
        }


def _sync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def content_fingerprint(index: dict) -> str:
    """A hash of what the files hold (the splits' token and offset hashes, dtype, vocabulary, EOS,
    tokenizer): equal for equal content, whichever path or machine wrote it."""
    content = {k: index[k] for k in ("dtype", "vocab_size", "eos_id", "splits")}
    content["tokenizer_sha256"] = index["tokenizer"]["sha256"]  # (not its file name)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def write_index(directory: Path, index: dict) -> dict:
    """Write DIR/index.json with its fingerprint (sorted keys, no times: the same run, the same bytes)."""
    index = {**index, "format": FORMAT, "fingerprint": content_fingerprint(index)}
    with open(directory / INDEX, "w") as f:
        f.write(json.dumps(index, indent=1, sort_keys=True) + "\n")
        _sync_close(f)
    return index
