"""The tokenizers of `ftjax data prepare` and `ftjax generate`: a local Hugging Face tokenizer.json or
SentencePiece model (nothing is downloaded), the ids of texts without special tokens of their own,
and the end-of-document (and optional begin-of-document) token of the token files."""

from __future__ import annotations

from pathlib import Path

from ftjax.program.corpus import PrepareError

DEFAULT_EOS = ("</s>", "<|endoftext|>")


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


Tokenizer = HFTokenizer | SentencePieceTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `.json` file is a Hugging Face tokenizer.json; anything else, a SentencePiece model."""
    if not Path(path).is_file():
        raise PrepareError(f"--tokenizer {path}: no such file (a tokenizer.json or a SentencePiece .model)")
    return HFTokenizer(path) if Path(path).suffix == ".json" else SentencePieceTokenizer(path)


def bos_of(tokenizer: Tokenizer, bos_token: str | None) -> dict[str, int | str]:
    """The index's record of `--bos`: {bos_id, bos_token}, or {} without it (recorded only when set:
    an index without BOS keeps the fingerprint it had)."""
    if bos_token is None:
        return {}
    bos_id = tokenizer.token_to_id(bos_token)
    if bos_id is None:
        raise PrepareError(f"--bos {bos_token!r}: not a token of the tokenizer")
    return {"bos_id": bos_id, "bos_token": bos_token}


def eos_of(tokenizer: Tokenizer, eos_token: str | None) -> tuple[str, int]:
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
