"""`ftjax bench data [CONFIG]`: token files against the training step they feed.

(a) prepare: `ftjax data prepare` (in this process, over `--workers` processes, default every core) on
    `--mib` of generated text, one JSONL file of documents of pseudo-words, with a byte-level BPE
    tokenizer trained here on its first MiB (`--vocab`; not timed): tokens/s, tokenized and written;
(b) loader: a replica's BatchStream over TokenWindows of those files (shuffled windows of
    model.seq_len + 1, CONFIG's data.batch_size, every batch built on this one core): tokens/s;
(c) step: `ftjax train CONFIG` standalone, task ftjax.program.tasks:token_lm on the same files: tokens/s of the
    median step after `--warmup`.

Prints one JSON line: the three rates, `loader_vs_step` = (b) / (c) (above 1: the loader outpaces the
step it feeds, on one core, without prefetching) and `prepare_vs_step` = (a) / (c) (how many steps'
worth of tokens one machine of these cores tokenizes in a step's time).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ftjax.base.procs import ProcessGroup
from ftjax.runtime.metrics import read_metrics
from ftjax_bench import common


def write_corpus(path: Path, mib: float, seed: int = 0) -> None:
    """Documents of 20 to 400 pseudo-words, Zipf-distributed over 5000 of them, as JSONL."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, rng.integers(1, 10))) for _ in range(5000)]
    with open(path, "w") as f:
        while f.tell() < mib * (1 << 20):
            ids = np.minimum(rng.zipf(1.3, rng.integers(20, 400)), len(words)) - 1
            f.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(2000))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        texts,
        trainer=trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(out))


def loader_rate(directory: Path, seq_len: int, batch_size: int, batches: int) -> float:
    """Tokens/s of a replica's batches (trained tokens: seq_len per row)."""
    from ftjax.program.data import BatchStream
    from ftjax.program.tokens import TokenWindows

    stream = BatchStream(TokenWindows(directory, "train", seq_len + 1), seed=0, batch_size=batch_size)
    stream.batch(0)  # (grain's first call sets up the dataset)
    t0 = time.perf_counter()
    for k in range(1, batches + 1):
        stream.batch(k)
    return batches * batch_size * seq_len / (time.perf_counter() - t0)


def step_rate(config: str, overrides: list[str], devices: int, out: Path, warmup: int, timeout: float) -> float:
    """Tokens/s of the median training step after `warmup` steps."""
    with ProcessGroup() as procs, open(out / "train.log", "w") as log:
        proc = procs.start(
            [sys.executable, "-m", "ftjax", "train", config, *overrides, "--out", str(out / "train")],
            device_count=devices,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"ftjax train failed:\n{(out / 'train.log').read_text()[-3000:]}")
    recs = [r for r in read_metrics(out / "train" / "metrics.jsonl") if r["step"] > warmup]
    if not recs:
        raise RuntimeError(f"{out / 'train'}: no steps after the {warmup} warm-up steps")
    return recs[0]["tokens"] / statistics.median(r["step_time_s"] for r in recs)


def main(argv: list[str]) -> int:
    p = common.parser("data", __doc__)
    p.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    p.add_argument("--mib", type=float, default=16.0, help="generated text to prepare, MiB (16)")
    p.add_argument("--vocab", type=int, default=4096, help="the BPE tokenizer's vocabulary (4096)")
    p.add_argument("--workers", type=int, default=None, help="prepare's processes (default: every core)")
    p.add_argument("--batches", type=int, default=200, help="loader batches timed (200)")
    p.add_argument("--steps", type=int, default=20, help="training steps timed")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compile, caches)")
    p.add_argument(
        "--out", default=None, help="keep the corpus, token files and run here (default: a temporary directory)"
    )
    p.add_argument("--timeout", type=float, default=540.0, help="seconds, limit for each run")
    args = p.parse_intermixed_args(argv)
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup + 1")
    cfg = common.load("data", args.config, args.overrides)
    if cfg is None:
        return 2
    from ftjax.program.prepare import prepare

    with common.run_directory("data", args.out) as out:
        write_corpus(out / "corpus.jsonl", args.mib)
        train_tokenizer(out / "corpus.jsonl", out / "tokenizer.json", args.vocab)
        index = prepare(
            [str(out / "corpus.jsonl")], out / "tokenizer.json", out / "tokens", workers=args.workers, force=True
        )
        tokens = sum(s["tokens"] for s in index["splits"].values())
        prepared = tokens / index["seconds"]
        loader = loader_rate(out / "tokens", cfg.model.seq_len, cfg.data.batch_size, args.batches)
        vocab = -(-index["vocab_size"] // 64) * 64  # (the model's vocabulary: the files' rounded up)
        step = step_rate(
            args.config,
            [
                *args.overrides,
                "task=ftjax.program.tasks:token_lm",
                f"task_args={json.dumps({'dir': str(out / 'tokens')})}",
                f"model.vocab_size={vocab}",
                f"steps={args.steps}",
                "ft.digest_every=0",
                "checkpoint.every=0",
            ],
            cfg.mesh.devices_per_host,
            out,
            args.warmup,
            args.timeout,
        )
    print(
        json.dumps(
            {
                "bench": "data",
                "config": args.config,
                "overrides": args.overrides,
                "cores": os.cpu_count(),
                "workers": args.workers or len(os.sched_getaffinity(0)),
                "corpus_mib": args.mib,
                "tokens": tokens,
                "vocab_size": index["vocab_size"],
                "prepare_tokens_per_s": round(prepared),
                "loader_tokens_per_s": round(loader),
                "step_tokens_per_s": round(step),
                "loader_vs_step": round(loader / step, 4),
                "prepare_vs_step": round(prepared / step, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
