"""The vocabulary of a run directory: every `event` name a replica writes to its
`replica-R/metrics.jsonl` and the launcher to `launcher.jsonl`, and the fields of a step record.

A record is one JSON object per line with `time` (time.time() when written; every process of a
`ftjax launch` job runs on one machine, so the files share one clock). An *event record* has
`event` (a name below) and no `step`; a *step record* has `step` and no `event`.

The values are the strings on disk: files written before this module and readers that still
spell them out use them, so a value never changes. The enums are `StrEnum`s: a member is its
string (`ReplicaEvent.START == "start"`, json.dumps writes "start"), so writers may pass members.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

TIME = "time"  # every record: seconds since the epoch when it was written
EVENT = "event"  # an event record: its name (a ReplicaEvent or a LauncherEvent)
REPLICA = "replica"  # a launcher event about one replica: its index R


EXIT_NO_PROGRESS = 75  # the progress watchdog ended the process (a restart may help: EX_TEMPFAIL)
EXIT_LEFT = 76  # the replica left the job when asked (SIGTERM), at a step boundary: not finished, not failed


class ReplicaEvent(StrEnum):
    """A replica's events in `replica-R/metrics.jsonl` (written by its leader process)."""

    START = "start"  # the process is up and about to join; the fields say who (replica, incarnation, pid, ...)
    INIT = "init"  # fresh weights from the seed: nobody had state at the start of the job
    INIT_FROM = "init_from"  # as INIT, but the weights (and with `opt` the optimizer state) came from the
    # orbax checkpoint at `path` (checkpoint.init_from); `params_digest` is theirs (ftjax.program.digest.params_digest)
    RESTORE = "restore"  # the state came from the latest durable checkpoint (restored_step, data_position)
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # durable checkpoint `step` failed its checksums (file, problem)
    STATE_UNAVAILABLE = "state_unavailable"  # the job has trained, yet no peer holds its state nor a checkpoint
    STALE_STATE = "stale_state"  # this replica's state is behind the job (step < job_step): it heals
    CATCHUP_STARTED = "catchup_started"  # the fetch of a snapshot from `source` began (at_step, min_step)
    CATCHUP_PROGRESS = "catchup_progress"  # a fetch under way: bytes_done of bytes_total, eta_s (every few s)
    CATCHUP_DONE = "catchup_done"  # snapshot installed, buffered updates replayed: it holds step `at_step`
    CATCHUP_FAILED = "catchup_failed"  # the fetch failed (error); the next quorum starts another
    CATCHUP_ABANDONED = "catchup_abandoned"  # the fetch was dropped: no longer behind, or the source left
    CATCHUP_CANCELLED = "catchup_cancelled"  # a quorum found it up to date again: the catch-up is not needed
    CATCHUP_GAP = "catchup_gap"  # the snapshot is older than the buffered updates reach: a fresher one is asked
    SNAPSHOT_OFFERED = "snapshot_offered"  # as a source: a snapshot of its state is served to peer `to`
    BATCHES_COMMITTED_BY_PEERS = "batches_committed_by_peers"  # its batches `batch_ids` were trained by peers
    POSITION_KEPT = "position_kept"  # the coordinator said a lower data position: its own is kept
    COMMIT_FAILURE = "commit_failure"  # a host's FTAR failed: step `step` is discarded and retried
    # ft.commit_decision coordinator: every host averaged step `step`, but the coordinator's `decision`
    # was not COMMIT (`detail`: why): the step is discarded; if a peer committed it, the next quorum heals this one
    COMMIT_NOT_DECIDED = "commit_not_decided"
    PEER_UNREACHABLE = "peer_unreachable"  # every attempt for `seconds` failed on `peer` (replica, host); on stderr too
    REPORT_UNDELIVERED = "report_undelivered"  # a failure report of `replica` did not reach the coordinator (`error`)
    PROGRESS_TIMEOUT = "progress_timeout"  # the watchdog saw no progress in `phase`: the process leaves the job
    DRAIN_TIMEOUT = "drain_timeout"  # trained every step; gave up waiting for healing peers after drain_timeout_s
    # its state's digest of `step` differed from the quorum's (majority_digest): it heals from `source`
    DIVERGED = "diverged"
    JOB_FINISHED = "job_finished"  # the job finished at `job_step` while this replica was behind (`step`) and
    # nobody alive held the final state: it exits 0 instead of training finished steps again (one history)
    LEFT = "left"  # asked to (SIGTERM: `reason`), the replica left the job at a step boundary (`step`); exit 76


class LauncherEvent(StrEnum):
    """The supervisor's decisions in `launcher.jsonl` (ftjax/launch/supervisor.py, RunLog)."""

    LAUNCH = "launch"  # the job: config, overrides, out, replicas, hosts, devices, steps, faults
    COORDINATOR_STARTED = "coordinator_started"  # a coordinator incarnation is up (pid, grpc, http)
    COORDINATOR_DOWN = "coordinator_down"  # the coordinator died (cause): restarted after the restart delay
    REPLICA_STARTED = "replica_started"  # an incarnation of replica R was started (incarnation, pids, die_at)
    REPLICA_DOWN = "replica_down"  # replica R died or was killed (cause, codes, step, at): it restarts
    REPLICA_DONE = "replica_done"  # every process of replica R exited 0: it finished
    NOT_RESTARTED = "not_restarted"  # replica R stays down: its peers finished, nobody holds the state
    ABANDONED = "abandoned"  # replica R was stopped for good: it could only start the job over
    HANG_DETECTED = "hang_detected"  # replica R is silent while its peers train: killed (replica_down follows)
    FAULT = "fault"  # an injected fault fired (kind: kill_catchup, kill_coordinator, hang, random_kill, partition)
    PARTITION_ENDED = "partition_ended"  # the links a partition cut (replica R, host, hosts) are restored
    KILL_MISSED = "kill_missed"  # the incarnation finished before its --kill point
    HOST_BACK = "host_back"  # host H of replica R is back from repair (--host-repair-s)
    BACK_TO_FULL_DEGREE = "back_to_full_degree"  # reduced replica R is asked to leave (SIGTERM) to restart whole
    REJOINED = "rejoined"  # a restarted replica R caught up (its catchup_done: at_step, catchup_s, source)
    CAUGHT_UP = "caught_up"  # a first incarnation caught up (it joined late)
    COMMIT_FAILURE = "commit_failure"  # replica R's commit_failure, copied (step, errors: how many)
    PEER_UNREACHABLE = "peer_unreachable"  # replica R's peer_unreachable, copied (peer, replica of the peer, seconds)
    WARM = "warm"  # every replica holds the job's state: the origin of fault times
    RANDOM_KILLS_STOPPED = "random_kills_stopped"  # --mtbf-s: too few steps left to recover from one more
    END = "end"  # the launcher is done (ok; error when it was not)


class StepField(StrEnum):
    """The fields of a step record (one per step a replica took part in) that the readers use;
    `step_record` writes the ones every writer has, in this order."""

    STEP = "step"  # the job's step count after this step (the first step is 1)
    COMMITTED = "committed"  # the update was applied to this replica's state
    HEALING = "healing"  # it contributed no batch: it relayed zeros (behind, or without state)
    LOSS = "loss"  # its own batch's loss (null when healing)
    TOKENS = "tokens"  # tokens of the rows it computed (0: a script's loop, which does not say)
    BATCH_ID = "batch_id"  # the id of its own batch, when committed with one
    DATA_POSITION = "data_position"  # the next batch of its stream after this step
    QUORUM_ID = "quorum_id"  # the quorum the step was trained in
    PARTICIPANTS = "participants"  # replicas in the step's quorum
    CONTRIBUTORS = "contributors"  # of which contributed a batch
    LR_SCALE = "lr_scale"  # the learning-rate scale of the update (ft.lr_scaling: fewer contributors)
    STEP_TIME_S = "step_time_s"  # seconds from the step's start to its record
    COMPUTE_S = "compute_s"  # of which computing the gradients (the built-in loop's split)
    QUORUM_WAIT_S = "quorum_wait_s"  # waiting for the quorum
    FTAR_S = "ftar_s"  # averaging (FTAR)
    COMMIT_S = "commit_s"  # the vote, the update, the digest and a checkpoint
    COMMIT_FAILURES = "commit_failures"  # steps this process's votes discarded so far
    DECISION_S = "decision_s"  # ft.commit_decision coordinator: the wait for the decision (within commit_s)
    PARAM_DIGEST = "param_digest"  # digest of its parameters after the step (every ft.digest_every steps)
    DIGEST_S = "digest_s"  # the seconds the digest took
    MODEL_FLOPS_PER_STEP = "model_flops_per_step"  # FLOPs of the rows it computed (the compiled step's cost analysis)
    MFU = "mfu"  # model FLOPs / (step time x devices x peak FLOP/s); absent where the peak is not known
    LR = "lr"  # the learning rate of its update (AdamW's schedule x lr_scale; absent: a task's own optimizer)
    EVAL_LOSS = "eval_loss"  # mean held-out loss of its share of eval.batches (every eval.every steps)
    EVAL_PERPLEXITY = "eval_perplexity"  # exp(eval_loss)


def step_record(
    *,
    step: int,
    committed: bool,
    healing: bool,
    loss: float | None,
    tokens: int,
    batch_id: int | None,
    data_position: int,
    quorum_id: int,
    participants: int,
    contributors: int,
    lr_scale: float,
    step_time_s: float,
    commit_failures: int,
    timings: Mapping[str, float] | None = None,
    protocol: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The fields of a step record that every writer has (the built-in loop, ftjax/runtime/trainer.py;
    a script's loop, ftjax/runtime/script.py), in their order on disk: `timings` (COMPUTE_S,
    QUORUM_WAIT_S, FTAR_S, COMMIT_S) follow STEP_TIME_S, and the protocol's fields (DECISION_S)
    COMMIT_FAILURES. A writer appends its own fields after these, then `digest_fields`."""
    head = {
        StepField.STEP: step,
        StepField.COMMITTED: committed,
        StepField.HEALING: healing,
        StepField.LOSS: loss,
        StepField.TOKENS: tokens,
        StepField.BATCH_ID: batch_id,
        StepField.DATA_POSITION: data_position,
        StepField.QUORUM_ID: quorum_id,
        StepField.PARTICIPANTS: participants,
        StepField.CONTRIBUTORS: contributors,
        StepField.LR_SCALE: lr_scale,
        StepField.STEP_TIME_S: step_time_s,
    }
    tail = {StepField.COMMIT_FAILURES: commit_failures}
    # plain strings on disk and in memory (a listener may compare keys by type)
    return {str(k): v for k, v in [*head.items(), *(timings or {}).items(), *tail.items(), *(protocol or {}).items()]}


def digest_fields(digest: str, seconds: float) -> dict[str, Any]:
    """A step record's digest of the state after the step and the seconds it took; none without one."""
    return {str(StepField.PARAM_DIGEST): digest, str(StepField.DIGEST_S): seconds} if digest else {}


def is_step(record: dict) -> bool:
    """A step record (an event record may carry a `step` field too)."""
    return StepField.STEP in record and EVENT not in record


def is_own_step(record: dict) -> bool:
    """A step the replica committed with its own batch: it trained."""
    return is_step(record) and bool(record.get(StepField.COMMITTED)) and not record.get(StepField.HEALING)
