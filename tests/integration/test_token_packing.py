"""Packing with document boundaries (`token_lm` with `task_args.packing: segments`): a window's
documents are numbered by the index's EOS id, attention stays within a document, and the target
after an EOS (the next document's first token) weighs 0 in the loss. Token files are written here."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

VOCAB, EOS, SEQ = 300, 299, 32


def write_token_files(directory, documents: list[list[int]]) -> None:
    """Token files (the layout `ftjax data prepare` writes) holding `documents` (EOS appended) in
    both splits."""
    from ftjax.program.tokens import SPLITS, SplitWriter, token_dtype, write_index

    docs = [np.asarray([*d, EOS]) for d in documents]
    splits = {}
    for split in SPLITS:
        w = SplitWriter(directory, split, token_dtype(VOCAB))
        w.append(np.concatenate(docs), np.asarray([len(d) for d in docs]))
        splits[split] = w.close()
    record = {"name": "test", "sha256": hashlib.sha256(b"test").hexdigest()}
    write_index(
        directory, {"dtype": "uint16", "vocab_size": VOCAB, "eos_id": EOS, "tokenizer": record, "splits": splits}
    )


def two_documents(seed: int) -> list[list[int]]:
    """A first document of 12 tokens (from `seed`), then a second (fixed) that runs past the window."""
    first = np.random.default_rng(seed).integers(0, EOS, 11).tolist()
    second = np.random.default_rng(99).integers(0, EOS, 2 * SEQ).tolist()
    return [first, second]


def llama_cfg(directory, packing: str):
    import json

    from ftjax.config import load_config

    args = json.dumps({"dir": str(directory), "packing": packing})
    return load_config(
        "llama_tiny",
        ["task=ftjax.program.tasks:token_lm", f"task_args={args}", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}"],
    )


def per_token(tmp_path, seed: int, packing: str):
    """(per-token losses, weights, the task) of window 0 under a fixed llama_tiny initialization."""
    from flax import nnx

    from ftjax.program import models
    from ftjax.program.task import load_task, stack
    from ftjax.program.tasks import token_losses

    directory = tmp_path / f"{seed}-{packing}"
    directory.mkdir()
    write_token_files(directory, two_documents(seed))
    cfg = llama_cfg(directory, packing)
    task = load_task(cfg.task, cfg, cfg.task_args)
    batch = stack([task.source[0]])
    with nnx.use_eager_sharding(False):
        model = models.build(cfg.model, nnx.Rngs(0))
    losses, weights = token_losses(model, batch)
    return np.asarray(losses[0]), np.asarray(weights[0]), task, batch


def test_packed_windows_number_documents_by_eos(tmp_path):
    from ftjax.program.tokens import TokenWindows

    write_token_files(tmp_path, two_documents(0))
    plain, packed = TokenWindows(tmp_path, "train", SEQ + 1), TokenWindows(tmp_path, "train", SEQ + 1, "segments")
    example = packed[0]
    assert np.array_equal(example["tokens"], plain[0]) and example["tokens"][11] == EOS
    assert example["segment_ids"].tolist() == [0] * 12 + [1] * (SEQ + 1 - 12)  # the EOS ends its document
    assert packed[1]["segment_ids"].tolist() == [0] * (SEQ + 1)  # a window inside one document
    # the packing is part of the data's identity (the job's checkpoints name it)
    assert packed.fingerprint != plain.fingerprint and packed.fingerprint.endswith("-segments")


def test_the_second_documents_losses_do_not_depend_on_the_first(tmp_path):
    a, wa, task, batch = per_token(tmp_path, 1, "segments")
    b, wb, _, _ = per_token(tmp_path, 2, "segments")
    # inputs 0..10 are document 1's, input 11 is its EOS (target: document 2's first token), then document 2's
    assert wa.tolist() == [1.0] * 11 + [0.0] + [1.0] * (SEQ - 12) and np.array_equal(wa, wb)
    assert not np.allclose(a[:11], b[:11])  # the first document did change
    np.testing.assert_allclose(a[12:], b[12:], rtol=0, atol=1e-6)
    # the task's loss per row: the mean over the weighted targets
    import jax

    params, state = task.init(jax.random.key(0))
    row = task.loss(params, state, batch, jax.random.key(0))[0]
    assert row.shape == (1,) and np.isfinite(float(row[0]))
    from ftjax.program.tasks import check_task

    check_task(llama_cfg(tmp_path / "1-segments", "segments"))  # (what `ftjax train` checks first: a batch of 2)
    # without packing, the second document's losses see the first
    c, wc, _, _ = per_token(tmp_path, 1, "none")
    d, _, _, _ = per_token(tmp_path, 2, "none")
    assert wc.min() == 1.0 and not np.allclose(c[12:], d[12:], rtol=0, atol=1e-6)


def test_packing_needs_a_model_with_segment_ids(tmp_path):
    from ftjax.config import load_config
    from ftjax.program.task import TaskError, load_task

    write_token_files(tmp_path, two_documents(0))
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}"])
    with pytest.raises(TaskError, match="packing=segments needs a model that takes segment ids"):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(tmp_path), "packing": "segments"})
    with pytest.raises(TaskError, match="task_args.packing: 'docs' is not one of none, segments"):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(tmp_path), "packing": "docs"})
