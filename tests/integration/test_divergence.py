"""Divergence is detected and healed: a replica whose state differs from the one the quorum keeps
(one bit flipped, `--flip-bit-at`) is found from the digests it sends with its next quorum request,
heals from a replica that agrees, and the incident is in its metrics and the job's summary."""

import json
import time

import pytest
from conftest import REPO
from ftjob import committed_digests, records

from ftjax.launch import LocalJob
from ftjax.runs.summary import build_summary, exit_code

TINY = f"{REPO}/configs/tiny.yaml"
FLIP = 8


@pytest.mark.slow
def test_a_flipped_bit_is_detected_at_the_next_quorum_and_healed_from_the_kept_state(tmp_path, procs):
    steps = 30
    job = LocalJob(TINY, [f"steps={steps}"], tmp_path, replicas=2, procs=procs)
    job.start_coordinator()
    job.start_replica(0)
    job.start_replica(1, extra_args=["--flip-bit-at", str(FLIP)])
    assert job.wait(timeout=240) == {0: [0], 1: [0]}, job.log_tail(1)

    d0, d1 = committed_digests(job.replica_dir(0)), committed_digests(job.replica_dir(1))
    assert d1[FLIP] != d0[FLIP] and all(d1[s] == d0[s] for s in range(1, FLIP))
    # two replicas, no majority: the first replica id's state is kept (docs/design/index.md)
    [incident] = [e for e in records(job.replica_dir(1))[1] if e["event"] == "diverged"]
    assert incident["step"] == FLIP and incident["source"] == "0", incident
    assert (incident["digest"], incident["majority_digest"]) == (d1[FLIP], d0[FLIP])
    assert not [e for e in records(job.replica_dir(0))[1] if e["event"] == "diverged"]
    # detected at the very next quorum: replica 1 applied no step after the flipped one before it
    # healed, every step it committed after the heal has replica 0's bits, and so has its end
    [done] = [e for e in records(job.replica_dir(1))[1] if e["event"] == "catchup_done"]
    # healed within 2 steps: found at the quorum after the flip, a snapshot of the flip's step (a few
    # ms for this model, against a step of ~0.1 s) and that quorum's step and the next replayed
    assert done["source"] == "0" and done["at_step"] <= FLIP + 2, done
    after = sorted(s for s in d1 if s > FLIP)
    assert all(s > done["at_step"] for s in after), (after, done)
    assert all(d1[s] == d0[s] for s in after), [(s, d1[s], d0[s]) for s in after if d1[s] != d0[s]]
    # the end: the same sha256 of the whole state, and the same per-step checksum as step `steps`'
    final = [json.loads((job.replica_dir(r) / "summary.json").read_text()) for r in (0, 1)]
    assert final[0]["param_digest"] == final[1]["param_digest"]
    assert final[0]["state_checksum"] == final[1]["state_checksum"] == d0[steps] == d1[steps]

    # the job's summary (the launcher's record of this run: it ended well) lists the incident
    (tmp_path / "launcher.jsonl").write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in (
                {"time": time.time() - 60, "event": "launch", "replicas": 2, "hosts": 1, "devices": 1, "steps": steps},
                {"time": time.time(), "event": "end", "ok": True},
            )
        )
    )
    summary = build_summary(tmp_path)
    assert [(d["replica"], d["step"], d["source"]) for d in summary["divergences"]] == [(1, FLIP, "0")]
    assert summary["digests_equal"] and exit_code(summary, 0) == (0, "")
