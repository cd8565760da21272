"""The job as the coordinator sees it, in TensorBoard (`RUN/tensorboard/job/`, beside the replicas'
`RUN/tensorboard/replica-R/`): per quorum formed, `job/quorum_size`, `job/contributors` and
`job/step` at the job's step; as they happen, the counters `job/failures` (failure reports the
coordinator acted on: the accused became a suspect or was dropped) and `job/catchups` (heals
started: a participant that heals from a peer in a formed quorum and did not in the one before; a
catch-up that spans several quorums is one), at the latest step.

CoordinatorState calls it under its lock, from the gRPC handlers: each call only queues (ftjax/runs/
scalars.py's ScalarWriter, one daemon thread writes the files), so no handler waits on a disk.
"""

from __future__ import annotations

from pathlib import Path

from ftjax.coordinator.quorum import Quorum
from ftjax.runs.scalars import ScalarWriter, tensorboard_sink

ACTED_ON = ("PENDING", "DROPPED")  # the verdicts of a failure report that counts in job/failures


class JobView:
    """TensorBoard event files of the job's quorums, failures and catch-ups under `directory`."""

    def __init__(self, directory: str | Path, flush_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self.failures = 0
        self.catchups = 0
        self._healing: frozenset[tuple[str, str]] = frozenset()  # (replica, incarnation) healing in the last quorum
        self._step = 0  # the job's latest quorum step: where a counter is marked
        self._writer = ScalarWriter([tensorboard_sink(self.directory, flush_s)], flush_s, name="coordinator-tb")

    def quorum(self, q: Quorum) -> None:
        self._step = max(self._step, q.step)
        figures: dict[str, float] = {
            "job/quorum_size": len(q.participants),
            "job/contributors": q.num_contributors,
            "job/step": q.step,
        }
        self._writer.scalars(figures, q.step)
        healing = frozenset((p.replica_id, p.incarnation) for p in q.participants if p.healing)
        if started := len(healing - self._healing):
            self.catchups += started
            self._writer.scalars({"job/catchups": self.catchups}, self._step)
        self._healing = healing

    def failure_report(self, verdict: str) -> None:
        if verdict in ACTED_ON:
            self.failures += 1
            self._writer.scalars({"job/failures": self.failures}, self._step)

    def close(self, timeout_s: float = 10.0) -> None:
        self._writer.close(timeout_s)
