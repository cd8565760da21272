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
import sys

from ftjax.program.corpus import PrepareError
from ftjax.program.prepare import prepare
from ftjax.program.tokenizer import DEFAULT_EOS
from ftjax.program.tokens import STORAGES, TokenFileError

__all__ = ["build_parser", "main"]


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
