"""Token files (ftjax/program/tokens.py), `ftjax data prepare` (ftjax/cli/prepare.py) and the `token_lm` task.

A corpus of a few hundred short documents and a byte-level BPE tokenizer (vocabulary 300) are made
here, once per module; nothing is downloaded."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FTJAX
from corpora import documents, train_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """40 text files (a directory) then a JSONL file of 260 lines (text in `body`); every document
    starts with its index. A BPE tokenizer.json trained on them, with `</s>`."""
    root = tmp_path_factory.mktemp("corpus")
    texts = documents(300)
    (root / "docs").mkdir()
    for i, text in enumerate(texts[:40]):
        (root / "docs" / f"doc_{i:03d}.txt").write_text(text)
    (root / "more.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts[40:])))
    tok = train_tokenizer(texts, root / "tokenizer.json", VOCAB)
    return {
        "root": root,
        "texts": texts,
        "tok": tok,
        "eos": tok.token_to_id("</s>"),
        "inputs": [str(root / "docs"), str(root / "more.jsonl")],
        "tokenizer": str(root / "tokenizer.json"),
    }


def prepare(corpus, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *FTJAX,
            "data",
            "prepare",
            *corpus["inputs"],
            "--field",
            "body",
            "--tokenizer",
            corpus["tokenizer"],
            "--out",
            str(out),
            "--heldout-fraction",
            "0.1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, Path]:
    """The corpus prepared twice: 2 workers with the default chunks, then 1 worker with 1 KiB chunks
    (about 20 work items, taken back in order)."""
    root = tmp_path_factory.mktemp("prepared")
    for out, extra in ((root / "a", ["--workers", "2"]), (root / "b", ["--workers", "1", "--chunk-mib", "0.001"])):
        done = prepare(corpus, out, *extra)
        assert done.returncode == 0, done.stderr
        assert "300 documents" in done.stdout
    return root / "a", root / "b"


def split_documents(directory: Path, split: str) -> list[np.ndarray]:
    tokens = np.fromfile(directory / split / "tokens.bin", dtype=np.uint16)
    offsets = np.load(directory / split / "offsets.npy")
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def doc_index(corpus, doc: np.ndarray) -> int:
    text = corpus["tok"].decode(doc[:-1].tolist())
    return int(text.split(":")[0].removeprefix("document "))


def test_prepare_twice_writes_the_same_bytes_whatever_the_workers_and_chunks(prepared):
    a, b = prepared
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert [str(f) for f in files] == [
        "heldout/offsets.npy",
        "heldout/tokens.bin",
        "index.json",
        "train/offsets.npy",
        "train/tokens.bin",
    ]
    assert sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) == files
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert not list(a.parent.glob(".*")), "a temporary directory was left behind"
    index = json.loads((a / "index.json").read_text())
    assert (
        index["dtype"] == "uint16" and index["vocab_size"] == VOCAB and index["tokenizer"]["name"] == "tokenizer.json"
    )


def test_documents_end_with_eos_and_the_heldout_split_is_disjoint_by_document(corpus, prepared):
    a, _ = prepared
    eos, seen = corpus["eos"], {}
    for split in ("train", "heldout"):
        docs = split_documents(a, split)
        for doc in docs:
            assert doc[-1] == eos and eos not in doc[:-1]  # EOS separates documents, and only it
        seen[split] = [doc_index(corpus, d) for d in docs]
        assert seen[split] == sorted(seen[split])  # input order within a split
        for i, doc in zip(seen[split], docs):
            assert doc[:-1].tolist() == corpus["tok"].encode(corpus["texts"][i], add_special_tokens=False).ids
    train, held = set(seen["train"]), set(seen["heldout"])
    assert held and not train & held and train | held == set(range(300))
    assert 10 <= len(held) <= 50  # about --heldout-fraction 0.1 of 300


def test_prepare_with_bos_starts_every_document_with_it(corpus, prepared, tmp_path):
    """`--bos TOKEN`: each document is BOS, its text, EOS (the rest the same bytes as without); the
    index records it. A token the tokenizer lacks is refused by name, exit 2."""
    token = corpus["tok"].id_to_token(3)  # (the test tokenizer has no <s>: any of its tokens will do)
    bos = corpus["tok"].token_to_id(token)
    done = prepare(corpus, tmp_path / "bos", "--bos", token, "--workers", "1")
    assert done.returncode == 0, done.stderr
    plain = split_documents(prepared[0], "train")
    docs = split_documents(tmp_path / "bos", "train")
    assert len(docs) == len(plain)
    for doc, without in zip(docs, plain):
        assert doc[0] == bos and doc[1:].tolist() == without.tolist()
    index = json.loads((tmp_path / "bos" / "index.json").read_text())
    assert index["bos_id"] == bos and index["bos_token"] == token
    assert "bos_id" not in json.loads((prepared[0] / "index.json").read_text())
    bad = prepare(corpus, tmp_path / "bad", "--bos", "<nope>")
    assert bad.returncode == 2 and "--bos '<nope>': not a token of the tokenizer" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_token_windows_are_the_encoded_documents_in_fixed_windows(corpus, prepared):
    from ftjax.program.tokens import TokenWindows

    a, b = prepared
    stream = []
    for i in sorted(doc_index(corpus, d) for d in split_documents(a, "train")):
        stream += corpus["tok"].encode(corpus["texts"][i], add_special_tokens=False).ids + [corpus["eos"]]
    src = TokenWindows(a, "train", 33)
    assert len(src) == len(stream) // 33 > 100
    for i in (0, 1, len(src) // 2, len(src) - 1):
        window = src[i]
        assert window.dtype == np.int32 and window.tolist() == stream[i * 33 : (i + 1) * 33]
    with pytest.raises(IndexError):
        src[len(src)]
    # the fingerprint names the content, split and window, not the directory
    assert TokenWindows(b, "train", 33).fingerprint == src.fingerprint
    assert (
        len({src.fingerprint, TokenWindows(a, "heldout", 33).fingerprint, TokenWindows(a, "train", 17).fingerprint})
        == 3
    )


def test_reading_maps_the_file_and_pickling_does_not_copy_it(prepared):
    from ftjax.program.tokens import TokenWindows

    src = TokenWindows(prepared[0], "train", 33)
    assert isinstance(src.tokens, np.memmap) and src.tokens.mode == "r"
    assert not isinstance(src[3], np.memmap)  # a window is a copy of its 33 tokens only
    blob = pickle.dumps(src)
    assert len(blob) < 1000  # the path, not the tokens
    copy = pickle.loads(blob)
    assert isinstance(copy.tokens, np.memmap) and np.array_equal(copy[5], src[5])


def test_a_jsonl_line_without_the_field_or_not_json_exits_2_naming_path_and_line(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"

    def prepare_bad(text: str) -> subprocess.CompletedProcess:
        bad.write_text(text)
        args = [str(bad), "--field", "body", "--tokenizer", corpus["tokenizer"], "--out", str(tmp_path / "out")]
        return subprocess.run(
            [*FTJAX, "data", "prepare", *args, "--workers", "1"], capture_output=True, text=True, timeout=60
        )

    done = prepare_bad('{"body": "one"}\n\n{"body": "two"}\n{"text": "three"}\n')
    assert done.returncode == 2
    assert f"{bad}:4: no field 'body'" in done.stderr and "Traceback" not in done.stderr
    done = prepare_bad('{"body": "one"}\n{"body": "two"\n')
    assert done.returncode == 2 and f"{bad}:2: not a JSON line" in done.stderr
    assert not list(tmp_path.glob("*out*")) and not list(tmp_path.glob(".*")), "partial output left behind"


def test_a_json_input_is_refused_naming_the_suffix_it_wants(tmp_path):
    from ftjax.program.corpus import PrepareError, list_inputs

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("text")
    (tmp_path / "docs" / "web.json").write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(PrepareError, match=r"web.json: a .json input .* name it .jsonl"):
        list_inputs([str(tmp_path / "docs")])
    assert list_inputs([str(tmp_path / "docs" / "a.txt")]) == [tmp_path / "docs" / "a.txt"]


def test_a_tokenizer_without_a_default_eos_names_the_flag(corpus, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ftjax.cli import prepare

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        corpus["texts"][:20],
        trainer=trainers.BpeTrainer(
            vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    tok.save(str(tmp_path / "no_eos.json"))
    argv = ["prepare", corpus["inputs"][0], "--tokenizer", str(tmp_path / "no_eos.json"), "--out", str(tmp_path / "o")]
    assert prepare.main(argv) == 2
    assert "--eos-token" in capsys.readouterr().err
    assert prepare.main([*argv, "--eos-token", "<nope>"]) == 2
    assert "--eos-token '<nope>': not a token of the tokenizer" in capsys.readouterr().err


def test_token_lm_refuses_a_model_vocabulary_smaller_than_the_files(prepared):
    from ftjax.config import load_config
    from ftjax.program.task import TaskError, load_task

    cfg = load_config("tiny", ["model.vocab_size=256", "model.seq_len=32"])
    with pytest.raises(
        TaskError,
        match=r"model.vocab_size \(256\) is smaller than the token files' vocabulary "
        rf"\({VOCAB}",
    ):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(prepared[0])})
    with pytest.raises(TaskError, match="task_args.dir: .*index.json: no such file"):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(prepared[0] / "nowhere")})


def test_evaluation_without_heldout_windows_says_why(prepared):
    from ftjax.config import load_config
    from ftjax.program.task import TaskError, load_task

    held = json.loads((prepared[0] / "index.json").read_text())["splits"]["heldout"]["tokens"]
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}", f"model.seq_len={held}", "eval.every=5"])
    with pytest.raises(TaskError, match=rf"eval.every=5: .*heldout split holds {held} tokens, fewer than one window"):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(prepared[0])})
    short = load_config("tiny", [f"model.vocab_size={VOCAB}", "model.seq_len=8", "eval.every=5"])
    with pytest.raises(TaskError, match="task_args.split is 'heldout'"):
        load_task("ftjax.program.tasks:token_lm", short, {"dir": str(prepared[0]), "split": "heldout"})
    no_eval = load_config("tiny", [f"model.vocab_size={VOCAB}", f"model.seq_len={held}"])
    assert load_task("ftjax.program.tasks:token_lm", no_eval, {"dir": str(prepared[0])}).heldout is None


def test_ftjax_train_runs_token_lm_on_the_prepared_files(prepared, tmp_path):
    run = tmp_path / "run"
    args = [
        "task=ftjax.program.tasks:token_lm",
        f"task_args={json.dumps({'dir': str(prepared[0])})}",
        "model.vocab_size=320",
        "model.seq_len=32",
        "steps=5",
        "ft.digest_every=0",
    ]
    done = subprocess.run(
        [*FTJAX, "train", "tiny", *args, "--out", str(run)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(r["loss"]) for r in steps) and steps[0]["tokens"] == 8 * 32
    assert steps[0]["loss"] < np.log(320) + 1  # next-token loss of a 320-way model at the start


def test_a_token_lm_config_is_checked_like_the_built_in_model():
    # token_lm is the model of `model:`: FSDP shards its d_model over the replica's devices
    from ftjax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.d_model \(64\) must be divisible by the replica's 3 devices"):
        load_config(
            "tiny",
            ["task=ftjax.program.tasks:token_lm", "task_args={dir: x}", "mesh.devices_per_host=3", "data.batch_size=9"],
        )


def test_prepare_with_a_sentencepiece_model_twice_writes_the_same_bytes(corpus, tmp_path):
    """A SentencePiece model trained here on the corpus (its own trainer, local files only)."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus["texts"]),
        model_prefix=str(tmp_path / "spm"),
        vocab_size=120,
        model_type="bpe",
        eos_id=1,
        bos_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    outs = []
    for name, extra in (("a", ["--workers", "2"]), ("b", ["--workers", "1", "--chunk-mib", "0.001"])):
        done = subprocess.run(
            [
                *FTJAX,
                "data",
                "prepare",
                *corpus["inputs"],
                "--field",
                "body",
                "--tokenizer",
                str(tmp_path / "spm.model"),
                "--out",
                str(tmp_path / name),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        outs.append(tmp_path / name)
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert len(files) == 5
    for f in files:
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f
    index = json.loads((outs[0] / "index.json").read_text())
    assert index["eos_id"] == sp.eos_id() == 1 and index["eos_token"] == "</s>" and index["vocab_size"] == 120
    assert index["tokenizer"]["name"] == "spm.model"
    docs = split_documents(outs[0], "train") + split_documents(outs[0], "heldout")
    assert len(docs) == 300 and all(d[-1] == 1 and 1 not in d[:-1] for d in docs)
    first = split_documents(outs[0], "train")[0]
    assert sp.decode(first[:-1].tolist()).startswith("document ")


def test_prepare_as_array_record_reads_the_same_windows_by_record(corpus, prepared, tmp_path):
    from ftjax.program.tokens import TokenWindows

    done = prepare(corpus, tmp_path / "ar", "--workers", "1", "--format", "array_record")
    assert done.returncode == 0, done.stderr
    files = sorted(str(p.relative_to(tmp_path / "ar")) for p in (tmp_path / "ar").rglob("*") if p.is_file())
    assert "train/tokens.array_record" in files and "train/tokens.bin" not in files
    flat, records = TokenWindows(prepared[0], "train", 33), TokenWindows(tmp_path / "ar", "train", 33, "segments")
    assert records.storage == "array_record" and records.tokens is None
    # the same tokens: the same content fingerprint and windows (windows that span several records)
    assert records.fingerprint == flat.fingerprint + "-segments" and len(records) == len(flat)
    for i in range(len(flat)):
        assert np.array_equal(records[i]["tokens"], flat[i]), i
    copy = pickle.loads(pickle.dumps(records))
    assert np.array_equal(copy[7]["tokens"], flat[7])
    records.verify()  # the tokens hash to the recorded sha256 in either storage


def test_token_files_changed_after_prepare_are_refused_by_check_and_by_training(prepared, tmp_path):
    """A token id past the index's vocabulary would be an embedding lookup past the table (NaN, and
    the run trained on, exit 0): a window that holds one is refused naming the token; `ftjax check`
    hashes the files against the index and refuses any change."""
    from ftjax.program.tokens import TokenFileError, TokenWindows

    changed = shutil.copytree(prepared[0], tmp_path / "changed")
    TokenWindows(changed, "train", 33).verify()  # intact: passes
    index = json.loads((changed / "index.json").read_text())
    tokens = np.memmap(changed / "train" / "tokens.bin", dtype=index["dtype"], mode="r+")
    tokens[33 * 5 + 2] = index["vocab_size"]  # window 5 of 33 tokens
    tokens.flush()
    del tokens
    src = TokenWindows(changed, "train", 33)
    src[4]  # its neighbours read as before
    with pytest.raises(TokenFileError, match=rf"token {33 * 5 + 2} \(window 5\) is {index['vocab_size']}, not below"):
        src[5]
    with pytest.raises(TokenFileError, match="do not hash to the sha256"):
        src.verify()
    args = [*_token_args(prepared), "steps=3"]
    args[1] = f"task_args={json.dumps({'dir': str(changed)})}"
    check = subprocess.run([*FTJAX, "check", "tiny", *args], capture_output=True, text=True, timeout=120)
    assert check.returncode == 2 and "changed after `ftjax data prepare`" in check.stderr, check.stderr[-2000:]
    assert check.stderr.count("\n") == 1, check.stderr  # one line


def _token_args(prepared) -> list[str]:
    return [
        "task=ftjax.program.tasks:token_lm",
        f"task_args={json.dumps({'dir': str(prepared[0])})}",
        "model.vocab_size=320",
        "model.seq_len=32",
    ]


def _train(run, *args) -> dict:
    done = subprocess.run(
        [*FTJAX, "train", "tiny", *args, "--out", str(run)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(600)  # three `ftjax train` runs in turn: 166 s in a hogged suite on a 2-core machine
def test_stop_and_resume_on_token_files_is_bitwise(prepared, tmp_path):
    """Issue 29: `--stop-after 20` then `--resume` on token files ends with the bits of the run that
    was never interrupted, every window trained once and in order."""
    args = [*_token_args(prepared), "steps=30", "checkpoint.every=10"]
    straight = _train(tmp_path / "straight", *args)
    _train(tmp_path / "resumed", *args, "--stop-after", "20")
    # resumed from the same token files at another path: the job is their content, not where they are
    moved = shutil.copytree(prepared[0], tmp_path / "moved")
    elsewhere = [*args[:1], f"task_args={json.dumps({'dir': str(moved)})}", *args[2:]]
    resumed = _train(tmp_path / "resumed", *elsewhere, "--resume")
    steps = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [r["batch_id"] for r in steps] == list(range(30))  # the stream resumed where it stopped
    assert resumed["param_digest"] == straight["param_digest"] and resumed["final_loss"] == straight["final_loss"]


@pytest.mark.timeout(660)
@pytest.mark.slow
def test_a_job_on_token_files_with_random_kills_ends_equal_exactly_once(prepared, launch):
    """Issue 29: 2 replicas on the prepared token files, whole replicas killed at random (`--mtbf-s`,
    seeded): every replica ends with the same digest, every batch trained exactly once."""
    run = launch("--replicas", "2", "--mtbf-s", "4", "--seed", "3", *_token_args(prepared), "steps=400")
    code = run.wait(timeout=600)
    s = run.summary()
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
    assert [e for e in s["failure_events"] if e["cause"] == "random_kill"], s["failure_events"]
    assert s["committed_steps"] == 400


def test_damaged_array_record_offsets_are_refused_naming_the_file(corpus, tmp_path):
    """The offsets say which records hold a window: swapped ones read other documents' tokens, every
    id in the vocabulary. Their recorded sha256 is checked at open (training) and by verify (check)."""
    from ftjax.config import load_config
    from ftjax.program.task import TaskError, load_task
    from ftjax.program.tokens import TokenFileError, TokenWindows

    done = prepare(corpus, tmp_path / "ar", "--workers", "1", "--format", "array_record")
    assert done.returncode == 0, done.stderr
    good = TokenWindows(tmp_path / "ar", "train", 33)
    path = tmp_path / "ar" / "train" / "offsets.npy"
    offsets = np.load(path)
    offsets[1:-1] = offsets[1:-1] + 1  # (still increasing, from 0 to the token count)
    np.save(path, offsets)
    with pytest.raises(TokenFileError, match=rf"^{path}: does not hash to the offsets_sha256"):
        TokenWindows(tmp_path / "ar", "train", 33)
    with pytest.raises(TokenFileError, match=rf"^{path}: does not hash"):
        good.verify()
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}", "model.seq_len=32"])
    with pytest.raises(TaskError, match=rf"task_args.dir: {path}: does not hash"):
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(tmp_path / "ar")})


def test_a_token_file_that_cannot_be_read_is_not_called_a_source_that_is_not_random_access(prepared, tmp_path):
    from ftjax.config import load_config
    from ftjax.program.task import TaskError, load_task

    changed = shutil.copytree(prepared[0], tmp_path / "changed")
    index = json.loads((changed / "index.json").read_text())
    tokens = np.memmap(changed / "train" / "tokens.bin", dtype=index["dtype"], mode="r+")
    tokens[3] = index["vocab_size"]  # in window 0: the one load_task reads
    tokens.flush()
    del tokens
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB + 20}", "model.seq_len=32"])
    with pytest.raises(TaskError) as e:
        load_task("ftjax.program.tasks:token_lm", cfg, {"dir": str(changed)})
    said = str(e.value)
    assert "not random access" not in said and "cannot read its first example: TokenFileError" in said, said
    assert f"token 3 (window 0) is {index['vocab_size']}, not below" in said, said


def test_two_concurrent_prepares_into_one_out_one_is_refused_naming_out(corpus, tmp_path, procs):
    """The first run holds `out` from its start to its rename: a second one started meanwhile exits
    2 naming --out, and the first one's files are what `out` holds. The first is stopped (SIGSTOP)
    while the second runs, so the two overlap whatever the machine's load."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    args = [*FTJAX, "data", "prepare", *corpus["inputs"], "--field", "body", "--tokenizer", corpus["tokenizer"]]
    first = procs.start([*args, "--out", str(out), "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.tmp-*")):  # (its temporary directory: made once it holds `out`)
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.005)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = subprocess.run(
            [*args, "--out", str(out), "--workers", "1"], capture_output=True, text=True, timeout=60
        )
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"--out {out}: another `ftjax data prepare` is writing it" in second.stderr
    assert second.stderr.count("\n") == 1 and not out.exists()
    stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr.decode()
    fingerprint = json.loads((out / "index.json").read_text())["fingerprint"]
    assert f"fingerprint {fingerprint}" in stdout.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # (no lock file, no temporary left)


def test_a_jsonl_lone_surrogate_escape_exits_2_naming_path_and_line(corpus, tmp_path):
    """`\\udcff` alone is valid JSON but not Unicode (no tokenizer encodes it): refused naming the
    file and line, not a worker's traceback; a pair (an emoji) is text like any other."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "one \\ud83d\\ude00"}\n{"body": "two"}\n{"body": "three \\udcff"}\n')
    args = [str(bad), "--field", "body", "--tokenizer", corpus["tokenizer"], "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [*FTJAX, "data", "prepare", *args, "--workers", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert f"{bad}:3: field 'body' holds a lone surrogate (\\udcff at character 6)" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    bad.write_text('{"body": "one \\ud83d\\ude00"}\n{"body": "two"}\n')
    done = subprocess.run(
        [*FTJAX, "data", "prepare", *args, "--workers", "1", "--heldout-fraction", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_a_document_longer_than_a_chunk_is_encoded_in_pieces_to_the_same_tokens(corpus, tmp_path):
    """~30 KB as one document, with chunks of 1 KiB: encoded ~30 pieces at a time, cut before a
    space between words, its tokens are the tokenizer's of the whole text (and a text without such
    a space stays whole)."""
    from ftjax.program.corpus import text_pieces

    text = "".join(t + ("\n" if i % 4 == 0 else " ") for i, t in enumerate(corpus["texts"])) + "end,  two  spaces"
    pieces = text_pieces(text, 1000)
    assert len(pieces) > 20 and "".join(pieces) == text and all(p.startswith(" ") for p in pieces[1:])
    assert text_pieces("x" * 5000, 1000) == ["x" * 5000]
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "one.txt").write_text(text)
    args = [str(tmp_path / "long"), "--tokenizer", corpus["tokenizer"], "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [*FTJAX, "data", "prepare", *args, "--chunk-mib", "0.001", "--heldout-fraction", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    [doc] = split_documents(tmp_path / "out", "train")
    assert doc.tolist() == corpus["tok"].encode(text).ids + [corpus["eos"]]


USER_TASK = """
import jax, jax.numpy as jnp, ftjax


def task(cfg, dir):
    source = ftjax.TokenWindows(dir, "train", cfg.model.seq_len + 1)  # the public API only

    def init(key):
        return {"embed": 0.02 * jax.random.normal(key, (source.vocab_size, 8))}

    def loss(params, tokens, key):
        logits = params["embed"][tokens[:, :-1]] @ params["embed"].T
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0].mean(1)

    return ftjax.pytree_task(init, loss, source)
"""


def test_a_users_task_reads_token_files_through_the_public_api(prepared, tmp_path):
    """A task of the user's own (not token_lm) on token files, through `ftjax.TokenWindows` alone:
    it loads and checks like any task, and its examples are the files' windows, bit for bit."""
    import ftjax
    from ftjax.config import load_config
    from ftjax.program.tasks import check_task

    (tmp_path / "mytokens.py").write_text(USER_TASK)
    args = ["task=mytokens:task", f"task_path={json.dumps([str(tmp_path)])}", "model.seq_len=32"]
    cfg = load_config("tiny", [*args, f"task_args={json.dumps({'dir': str(prepared[0])})}"])
    task = check_task(cfg)
    assert isinstance(task.source, ftjax.TokenWindows)
    tokens = np.fromfile(prepared[0] / "train" / "tokens.bin", np.uint16)
    assert len(task.source) == len(tokens) // 33
    for i in (0, 7, len(task.source) - 1):
        assert np.array_equal(task.source[i], tokens[33 * i : 33 * (i + 1)].astype(np.int32)), i
    with pytest.raises(ftjax.TokenFileError, match="index.json: no such file"):
        ftjax.TokenWindows(tmp_path / "nowhere")
