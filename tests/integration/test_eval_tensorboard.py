"""Held-out evaluation (`eval:`) and TensorBoard event files (`log.tensorboard`), end to end: `ftjax
train` and `ftjax launch` on token files made here (a small corpus and a BPE tokenizer, nothing
downloaded)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FTJAX
from corpora import documents, train_tokenizer

from ftjax.runs.jsonl import read_jsonl


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """300 short documents in a JSONL file, a BPE tokenizer (vocabulary 300) trained on them, and the
    token files `ftjax data prepare` makes of them (a fifth of the documents held out)."""
    root = tmp_path_factory.mktemp("eval_corpus")
    texts = documents(300)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, root / "tokenizer.json", 300)
    out = root / "tokens"
    done = subprocess.run(
        [*FTJAX, "data", "prepare", str(root / "corpus.jsonl"), "--tokenizer", str(root / "tokenizer.json")]
        + ["--out", str(out), "--heldout-fraction", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def token_args(directory: Path, *extra: str) -> list[str]:
    return [
        "task=ftjax.program.tasks:token_lm",
        f"task_args={json.dumps({'dir': str(directory)})}",
        "model.vocab_size=320",
        "model.seq_len=32",
        *extra,
    ]


def train(directory: Path, run: Path, *extra: str) -> list[dict]:
    done = subprocess.run(
        [*FTJAX, "train", "tiny", *token_args(directory, *extra), "--out", str(run)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in read_jsonl(run / "metrics.jsonl") if "step" in r and "event" not in r]


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under `directory`, by tag and step (read with TensorBoard's own
    reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_eval_loss_every_eval_every_steps_and_the_same_values_in_tensorboard(tokens, tmp_path):
    steps = train(tokens, tmp_path / "on", "steps=7", "eval.every=3", "eval.batches=3")
    assert [r["step"] for r in steps] == list(range(1, 8))
    evaluated = [r for r in steps if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    for r in evaluated:
        assert np.isfinite(r["eval_loss"]) and r["eval_batches"] == [0, 1, 2]
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert summary["last_eval_loss"] == evaluated[-1]["eval_loss"]

    tb = scalars(tmp_path / "on" / "tensorboard")  # a standalone run: RUN/tensorboard/
    assert tb["eval/loss"] == pytest.approx({r["step"]: r["eval_loss"] for r in evaluated}, rel=1e-6)
    assert tb["eval/perplexity"] == pytest.approx({r["step"]: r["eval_perplexity"] for r in evaluated}, rel=1e-6)
    assert tb["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in steps}, rel=1e-6)
    assert set(tb["quorum/participants"].values()) == {1.0} and len(tb["tokens_per_s"]) == 7
    assert tb["lr"] == pytest.approx({r["step"]: r["lr"] for r in steps}, rel=1e-6)


def test_evaluation_changes_nothing_of_the_training(tokens, tmp_path):
    common = ("steps=6", "ft.digest_every=1")
    on = train(tokens, tmp_path / "on", *common, "eval.every=2", "eval.batches=2")
    off = train(tokens, tmp_path / "off", *common, "log.tensorboard=false")
    assert [r["param_digest"] for r in on] == [r["param_digest"] for r in off]
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    final = [json.loads((tmp_path / d / "summary.json").read_text())["param_digest"] for d in ("on", "off")]
    assert final[0] == final[1]
    assert not (tmp_path / "off" / "tensorboard").exists()


def test_eval_on_a_task_without_held_out_data_is_one_line_naming_eval_every(tmp_path):
    done = subprocess.run(
        [*FTJAX, "train", "tiny", "eval.every=2", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "eval.every=2" in done.stderr and "held-out" in done.stderr


@pytest.mark.timeout(660)
@pytest.mark.slow
def test_a_replica_killed_during_an_evaluation_changes_neither_digests_nor_exactly_once(launch, tokens):
    """2 replicas evaluate every 100 steps, each its own share of 3 held-out batches; replica 1 is
    killed in the middle of its evaluation of step 200 (after the commit, before its record), restarts,
    catches up and evaluates again. Its TensorBoard files hold what each incarnation wrote (the killed
    one's unflushed tail is lost with it; metrics.jsonl's line is not written either)."""
    # The restarted replica evaluates again at each evaluation step after its rejoin: it rejoined at
    # step 423 (6 s after its kill) on a quiet machine, at step 600 with both cores busy (`yes`
    # twice), at step 1000 (the job's end: nothing left to evaluate) with two more tests beside it.
    run = launch(
        "--replicas", "2", "--kill", "1@200:eval", *token_args(tokens, "steps=1000", "eval.every=100", "eval.batches=3")
    )
    code = run.wait(timeout=600)
    s = run.summary()
    assert [(e["replica"], e["cause"], e["at"]) for e in s["failure_events"]] == [(1, "kill", "200:eval")]
    assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
    (rejoined,) = [e for e in run.events() if e["event"] == "rejoined"]
    assert rejoined["replica"] == 1, run.output()
    back = rejoined["at_step"]
    for r, share in ((0, [0, 2]), (1, [1])):
        evaluated = {m["step"]: m for m in run.metrics(r) if "eval_loss" in m}
        assert evaluated and all(step % 100 == 0 and m["eval_batches"] == share for step, m in evaluated.items())
        assert s["replicas"][str(r)]["last_eval_loss"] == evaluated[max(evaluated)]["eval_loss"]
        tb = scalars(run.run_dir / "tensorboard" / f"replica-{r}")["eval/loss"]
        assert tb == pytest.approx({step: evaluated[step]["eval_loss"] for step in tb}, rel=1e-6)
        if r == 0:
            assert set(tb) == set(evaluated) == set(range(100, 1001, 100))
        else:  # the first incarnation's 100 (its 200: killed in it), then the restarted one's
            assert {100} <= set(evaluated) <= {100} | set(range(100 * (back // 100 + 1), 1001, 100)), back
            # every evaluation step it was back well before (a rejoin is one step's race with the quorum)
            assert set(range(100 * ((back + 20) // 100 + 1), 1001, 100)) <= set(evaluated), back
            # the killed incarnation's step 200 may be on disk (its scalars are written before the line)
            assert set(evaluated) <= set(tb) <= set(evaluated) | {200}
    assert 200 not in {m["step"] for m in run.metrics(1) if "step" in m and "event" not in m}


def test_a_process_killed_right_after_an_evaluation_keeps_every_evaluation_in_its_event_files(tokens, tmp_path):
    """SIGKILL (no `finally`, nothing closed) as soon as metrics.jsonl holds its third evaluation:
    the event files hold every evaluation that metrics.jsonl does (each is on disk before its line
    is written), not just the first, which tensorboardX's own writer flushed at once."""
    import os
    import signal
    import time

    from ftjax.base.procs import ProcessGroup

    run = tmp_path / "killed"
    evals: list[dict] = []
    with ProcessGroup() as procs, open(tmp_path / "train.log", "w") as log:
        proc = procs.start(
            [*FTJAX, "train", "tiny", *token_args(tokens, "steps=100000", "eval.every=1", "eval.batches=1")]
            + ["--out", str(run)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 240
        while len(evals) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r] if run.exists() else []
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL, (tmp_path / "train.log").read_text()[-3000:]
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r]  # (more may have come)
    assert len(evals) >= 3
    tb = scalars(run / "tensorboard")["eval/loss"]
    # an evaluation's scalars go to disk before its line: the kill may fall between the two, so the
    # event files may hold one evaluation more (the next step's, eval.every=1), never one fewer
    last = max(r["step"] for r in evals)
    assert set(tb) - {r["step"] for r in evals} <= {last + 1}, (sorted(tb), last)
    assert {s: tb[s] for s in tb if s <= last} == pytest.approx({r["step"]: r["eval_loss"] for r in evals}, rel=1e-6)
