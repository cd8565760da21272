"""`RUN/summary.json`: what a launched job achieved, computed from its run directory alone.

Inputs: `RUN/launcher.jsonl` (the supervisor's decisions: starts, deaths, faults, the end),
`RUN/replica-R/metrics.jsonl` (each replica's step and event records, all incarnations appended)
and `RUN/replica-R/summary.json` (written by a replica's leader when it finishes).

Definitions (times are the replicas' own `time` stamps, all on one machine):

- **warm-up end** `t_warm`: the first moment every replica has committed a step with its own
  batch. Before it, replicas start and compile at different speeds; no failure is measured there.
- **gaps**: the times between consecutive committed step records of one incarnation of a replica,
  both at or after `t_warm`. A replica *failed* if any of its processes died (or hung) during the
  run, or a fault was aimed at it: a `--hang` stop shorter than the hang timeout is never detected
  nor killed, yet the gap it leaves is the replica's own freeze, not a wait for a peer.
  `median_step_s` is the median of the gaps of the replicas that never failed (of all replicas
  when every one failed); `max_healthy_stall_s` the largest stall of a replica that never failed
  (null when every one failed): how long a failure elsewhere made a healthy replica wait, at the
  failure or at the failed replica's return (a step that replica compiled in: a loop without
  `warm_up`, worst with a cold compile cache). A stall
  is a gap, less the time its step spent computing rows of other replicas' batches (a constant
  global batch: the survivors compute an absent peer's rows, `work`), counted at the median rate
  of one batch (median_step_s / the batch's rows): that is work, not waiting. In an elastic run
  a stall is the gap. `max_healthy_gap_s` is the largest gap itself. `max_healthy_wait_s` is the
  largest *wait* of a replica that never failed: a gap less that replica's own computing and
  committing in the step (`compute_s`, `commit_s` of its record), so its quorum wait, FTAR and the
  time between steps; a machine's load on the replica's own work counts in its stall, not here
  (null where no record splits its step).
- **timeline**: each replica's lifecycle segments (`ftjax.runs.lifecycle`, the fold the launcher's live
  view uses too) over its records and the launcher's events about it: `starting` (process started,
  no own step yet), `training`, `stalled` (a gap between its own steps that breaks the stall rule:
  longer than 2 x median_step_s), `catching up` (from `stale_state` or `catchup_started`, or a step
  in which it only relays zeros, until its first own step), `down` (from its death to its restart),
  `done`, or `gone` (not restarted or abandoned).
- **ettr** (effective training time, as FT-HSDP measures it: the fraction of GPU-time spent in
  productive training): over the window W = [t_warm, last committed step of the job],
  ettr = sum over replicas of productive time / (R x |W|). Productive time is the replica's
  `training` time, plus one median step for each `stalled` gap (the step itself was productive,
  the wait was not). Down, starting, catching-up time is not productive; neither is a replica that
  finished early (its share of the window after its end counts as idle). A job that did not commit
  its last step (abandoned, out of restarts or time) has no ETTR: null, and `ettr_why` says why (its
  window would end at its last commit, and time lost after it would not count).
- **error**: the launcher's reason when it stopped the job (the `end` event's error: a replica out
  of restarts, refused twice for the same reason, the timeout), null when it did not.
- **incarnations** (per replica): each incarnation's number, how it ended (`cause`: done, a
  replica_down's cause such as crash, watchdog or refused, abandoned, not_restarted, running at
  the end), the last line its dead host wrote (`error`), and the steps it contributed (its own
  batch) and committed; **refusals** (per replica): the incarnations refused (`ftjax train` exit 2)
  with the reason.
- **exactly_once**: for every replica r of R, the batches trained for its stream are exactly
  {k*R + r : k < its final data position}, none twice. A batch counts as trained when r committed
  a step with it (`batch_id`), or when peers committed the step r contributed it to while r did not
  (`batches_committed_by_peers`; a restarted incarnation lists there every batch before its resume
  point, including those an earlier incarnation committed itself, which are no repeat). A batch
  that r commits after it was trained either way is a repeat. A restore from a durable checkpoint
  (`restore`, at data position P) undoes the batches from P on: the restored state never saw them.
  A run that is not exactly once fails (`ok` false, the launcher exits 1, naming the batch).
  With a constant global batch (`ft.global_batch: constant`, steps recorded with their `work`)
  the check is per step instead (`constant_batch`): every step from 1 to the last was committed,
  every replica that committed it recorded the same work, and that work trains each row of the
  step's R batches exactly once (`ftjax.base.batches.check_tiling`), whoever computed it.
- **constant_batch** (constant global batch only): that check, and who computed whose rows: the
  steps in which some rows were computed by another replica than their own, the rows each replica
  computed for others, and each run of consecutive steps with the same reassignment.
- **median_mfu** (per replica): the median of its committed steps' `mfu` (model FLOPs / (step
  time x devices x peak FLOP/s), ftjax/runtime/metrics.py), null when no step carried one (no known
  peak: CPU without `hardware.peak_flops_per_device`).
- **last_eval_loss** (per replica): the `eval_loss` of its latest committed step that evaluated
  (`eval.every`), null when none did.
- **failure_events**: every replica death and coordinator loss, with `recovery_s` (from a
  replica's death to its rejoin, when it rejoined: restart delay + start + catch-up).
- **partitions** (`--partition`, a virtual cluster): for each cut, the replica and host, the
  step the launcher saw when it cut, and what was committed in its window, from its cut record to
  its own end record (matched by the window's number: overlapping windows end in any order):
  `in_flight` is the step after the replica's last commit before the cut (its records may land
  just after the cut record: it committed before its links went),
  `isolated_commits` every other step the cut-off replica committed without a peer (none, or
  there was a split brain; a step committed with a peer in a quorum of the same size was trained
  together before the links went, on a machine too busy to cut them at once), `peer_commits`
  how many steps each other replica committed meanwhile (it trains on), and `rejoined_at_step`
  where the cut-off replica caught up afterwards (null: it did not).
- **divergences**: every incident in which the coordinator found a replica's state digest of a
  step different from the one it kept (the majority's) and made it heal (`diverged` events).
  Replicas that end with different digests make `ftjax launch` exit 1 (`exit_code`).
- **split_history**: the steps committed in two quorum lineages: by commits with different quorum
  ids whose parameter digests at that step differ (a cut-off replica that trained on alone, two
  processes with one replica id). One history commits a step once, in one quorum, whoever
  commits it; a whole-job restart from a checkpoint commits its steps again with the same digests,
  which is no split. A split history makes the launcher exit non-zero. A replica that ended behind
  a finished job (`job_finished`: it was cut off, and nobody alive held the final state) is
  `ended_behind`: its digest is not the job's and is left out of `digests_equal`.
- **digests**: a replica's `param_digest` is the one its `RUN/replica-R/summary.json` records (the
  sha256 of its final state), none when it did not finish. Its step records' `param_digest`s are
  the per-step checksum, another function of the state: never compared with a final one.
- **final_loss**: the mean training loss of every contribution in the last 5% of the steps (at
  least the last step), over all replicas: a single batch's loss is too noisy to compare runs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftjax.base.batches import check_tiling
from ftjax.runs.events import EVENT, REPLICA, TIME, LauncherEvent, ReplicaEvent, StepField, is_own_step, is_step
from ftjax.runs.jsonl import read_jsonl
from ftjax.runs.lifecycle import Phase, segments

DOWN_EVENTS = (LauncherEvent.REPLICA_DOWN, LauncherEvent.NOT_RESTARTED, LauncherEvent.ABANDONED)


@dataclass
class Incarnation:
    start: float
    end: float
    ended_by: str  # replica_down | replica_done | not_restarted | abandoned | end
    records: list[dict] = field(default_factory=list)


@dataclass
class Run:
    """A run directory, read."""

    path: Path
    launch: dict
    events: list[dict]
    replicas: int
    steps: int
    metrics: dict[int, list[dict]]
    finals: dict[int, dict | None]
    start: float
    end: float

    def incarnations(self, r: int) -> list[Incarnation]:
        """Replica r's incarnations, each with the metrics records written during it."""
        out: list[Incarnation] = []
        for e in self.events:
            if e.get(REPLICA) != r:
                continue
            if e[EVENT] == LauncherEvent.REPLICA_STARTED:
                out.append(Incarnation(e[TIME], self.end, "end"))
            elif e[EVENT] in (*DOWN_EVENTS, LauncherEvent.REPLICA_DONE) and out and out[-1].ended_by == "end":
                out[-1].end, out[-1].ended_by = e[TIME], e[EVENT]
        for rec in self.metrics.get(r, []):
            for inc in out:  # records belong to the incarnation whose lifetime holds them
                if inc.start <= rec.get(TIME, 0) <= inc.end:
                    inc.records.append(rec)
                    break
        return out

    def records(self, r: int) -> list[dict]:
        """Replica r's records and the launcher's events about it, in time order (at equal times the
        replica's first: the launcher logs a replica's death or end after reading its last records)."""
        about = [e for e in self.events if e.get(REPLICA) == r]
        return sorted([*self.metrics.get(r, []), *about], key=lambda rec: rec[TIME])


def load_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    events = read_jsonl(path / "launcher.jsonl")
    launch = next((e for e in events if e.get(EVENT) == LauncherEvent.LAUNCH), None)
    if launch is None:
        raise ValueError(f"{path}: no launcher.jsonl with a 'launch' record: not a run directory of `ftjax launch`")
    replicas = int(launch["replicas"])
    metrics = {r: read_jsonl(path / f"replica-{r}" / "metrics.jsonl") for r in range(replicas)}
    finals = {}
    for r in range(replicas):
        f = path / f"replica-{r}" / "summary.json"
        finals[r] = json.loads(f.read_text()) if f.exists() else None
    times = [e[TIME] for e in events] + [m[TIME] for recs in metrics.values() for m in recs if TIME in m]
    return Run(path, launch, events, replicas, int(launch["steps"]), metrics, finals, launch[TIME], max(times))


# --- pieces ---------------------------------------------------------------------------------------
def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if is_step(r)]


def warm_time(run: Run) -> float | None:
    """The first moment every replica has committed a step with its own batch (None: never)."""
    firsts = []
    for r in range(run.replicas):
        t = next((s[TIME] for s in run.metrics[r] if is_own_step(s)), None)
        if t is None:
            return None
        firsts.append(t)
    return max(firsts)


def failed_replicas(run: Run) -> set[int]:
    """Replicas that died, hung, or that a fault was aimed at (a `--hang` stop leaves no other trace
    when it ends before the hang timeout)."""
    return {
        e[REPLICA]
        for e in run.events
        if e[EVENT] in (LauncherEvent.REPLICA_DOWN, LauncherEvent.HANG_DETECTED)
        or (e[EVENT] == LauncherEvent.FAULT and REPLICA in e)
    }


def _consecutive_steps(run: Run, r: int, t_warm: float) -> list[tuple[dict, dict]]:
    """Pairs of consecutive committed step records of one incarnation of replica r, after warm-up."""
    pairs = []
    for inc in run.incarnations(r):
        steps = [s for s in _steps(inc.records) if s.get(StepField.COMMITTED) and s[TIME] >= t_warm]
        pairs += list(zip(steps, steps[1:]))
    return pairs


def step_gaps(run: Run, r: int, t_warm: float) -> list[tuple[float, float, int]]:
    """Gaps between consecutive committed steps of one incarnation of replica r, after warm-up: (the
    later step's time, the gap, the rows of other replicas' batches r computed in that step:
    a survivor computes an absent peer's rows with a constant global batch; 0 in an elastic run)."""
    return [(b[TIME], b[TIME] - a[TIME], taken_over(b, r)) for a, b in _consecutive_steps(run, r, t_warm)]


def step_waits(run: Run, r: int, t_warm: float) -> list[tuple[float, float]]:
    """(the later step's time, the wait) for each gap of `step_gaps` whose later record splits its
    step (`compute_s` and `commit_s`: the built-in loop's records and a script's): the gap less the
    replica's own computing and committing, so the time it spent waiting for its quorum, for FTAR
    (its peers) and between steps. A loaded machine slows a replica's own computing and digest
    (2 s for a 4 ms digest, once, on a busy 2-core machine): that counts in its stall, not here."""
    waits = [(b[TIME], step_wait(a, b)) for a, b in _consecutive_steps(run, r, t_warm)]
    return [(t, w) for t, w in waits if w is not None]


def step_wait(a: dict, b: dict) -> float | None:
    """The wait of the gap between step records `a` and `b` of one replica: the gap less `b`'s own
    `compute_s` and `commit_s` (None when `b` does not split its step)."""
    compute, commit = b.get(StepField.COMPUTE_S), b.get(StepField.COMMIT_S)
    if not (isinstance(compute, (int, float)) and isinstance(commit, (int, float))):
        return None
    return max(0.0, b[TIME] - a[TIME] - compute - commit)


def taken_over(step: dict, r: int) -> int:
    """Rows of other replicas' batches that replica r computed in this step record."""
    return sum(int(b) - int(a) for who, stream, a, b in step.get("work") or () if who == r and stream != r)


def median_step(run: Run, t_warm: float | None) -> tuple[float | None, list[tuple[float, float, float]]]:
    """`median_step_s` (None: no gap) and the gaps of the replicas that never failed, each as (the
    time it ended, the gap, the stall: the gap less the time to compute the rows taken over from
    other replicas at the median rate); see the module docstring."""
    healthy = [r for r in range(run.replicas) if r not in failed_replicas(run)]
    gaps = {r: step_gaps(run, r, t_warm) if t_warm is not None else [] for r in range(run.replicas)}
    pool = [g for r in (healthy or range(run.replicas)) for _, g, _ in gaps[r]]
    if not pool:
        return None, []
    median = statistics.median(pool)
    per_row = median / batch_rows(run) if batch_rows(run) else 0.0
    return median, [(t, g, g - extra * per_row) for r in healthy for t, g, extra in gaps[r]]


def max_healthy_wait(run: Run, t_warm: float | None) -> float | None:
    """`max_healthy_wait_s`: the largest `step_waits` wait of a replica that never failed (None when
    every one failed, before warm-up, or when no record splits its step)."""
    if t_warm is None:
        return None
    failed = failed_replicas(run)
    waits = [w for r in range(run.replicas) if r not in failed for _, w in step_waits(run, r, t_warm)]
    return round(max(waits), 4) if waits else None


def batch_rows(run: Run) -> int:
    """Rows of one replica's batch, from the steps' `work` (0: an elastic run records none)."""
    return max(
        (int(b) for r in range(run.replicas) for s in _steps(run.metrics[r]) for _, _, _, b in s.get("work") or ()),
        default=0,
    )


def exactly_once(run: Run, r: int) -> tuple[bool, str]:
    """(ok, why not) for replica r's data stream (see the module docstring)."""
    trained: set[int] = set()
    for rec in run.metrics[r]:
        if rec.get(EVENT) == ReplicaEvent.BATCHES_COMMITTED_BY_PEERS:
            trained.update(rec.get("batch_ids") or [])
        elif rec.get(EVENT) == ReplicaEvent.RESTORE and rec.get("data_position") is not None:
            # the state went back to a durable checkpoint: the batches after its position are undone
            # (trained again from it, they are no repeat; the job's history is the restored one)
            position = int(rec["data_position"])
            trained = {b for b in trained if (b - r) // run.replicas < position}
        elif is_step(rec) and rec.get(StepField.COMMITTED) and rec.get(StepField.BATCH_ID) is not None:
            b = int(rec[StepField.BATCH_ID])
            if b in trained:
                return False, f"batch {b} trained twice (again at step {rec[StepField.STEP]})"
            trained.add(b)
    position = final_position(run, r)
    expected = {k * run.replicas + r for k in range(position)}
    if trained != expected:
        missing, extra = sorted(expected - trained), sorted(trained - expected)
        return False, f"data position {position}: missing batches {missing[:5]}, unexpected {extra[:5]}"
    return True, ""


def constant_batch(run: Run) -> dict[str, Any] | None:
    """The constant-batch check and who computed whose rows (see the module docstring); None when
    the run's steps carry no `work` (an elastic run)."""
    by_step: dict[int, list] = {}
    for r in range(run.replicas):
        for rec in _steps(run.metrics[r]):
            if rec.get(StepField.COMMITTED) and rec.get("work") is not None:
                by_step.setdefault(int(rec[StepField.STEP]), []).append(rec["work"])
    if not by_step:
        return None
    rows = max(int(w[3]) for works in by_step.values() for w in works[0])
    errors = [f"step {n}: committed by nobody" for n in range(1, max(by_step) + 1) if n not in by_step]
    runs: list[list] = []  # [first step, last step, [[who, stream, a, b] computed for another]]
    for_others: dict[str, int] = {str(r): 0 for r in range(run.replicas)}
    for n, works in sorted(by_step.items()):
        if any(w != works[0] for w in works):
            errors.append(f"step {n}: the replicas that committed it recorded different work")
        if why := check_tiling(run.replicas, rows, works[0]):
            errors.append(f"step {n}: {why}")
        others = [w for w in works[0] if w[0] != w[1]]
        for who, _, a, b in others:
            for_others[str(who)] = for_others.get(str(who), 0) + b - a
        if others and runs and runs[-1][1] == n - 1 and runs[-1][2] == others:
            runs[-1][1] = n
        elif others:
            runs.append([n, n, others])
    return {
        "exactly_once": not errors,
        **({"error": errors[0]} if errors else {}),
        "steps_with_reassigned_rows": sum(last - first + 1 for first, last, _ in runs),
        "rows_computed_for_others": for_others,
        "reassignments": runs,
    }


def final_position(run: Run, r: int) -> int:
    final = run.finals.get(r)
    if final and "data_position" in final:
        return int(final["data_position"])
    steps = _steps(run.metrics[r])
    return int(steps[-1][StepField.DATA_POSITION]) if steps else 0


def timeline(run: Run, median_s: float | None) -> dict[int, list[tuple[float, float, str]]]:
    """Each replica's (start, end, phase name) segments over the run (see the module docstring)."""
    return {
        r: [(g.start, g.end, g.phase.value) for g in segments(run.records(r), median_s, run.end, run.steps)]
        for r in range(run.replicas)
    }


def ettr(
    run: Run, segments: dict[int, list[tuple[float, float, str]]], t_warm: float, t_end: float, median_s: float
) -> float | None:
    """Effective training time over [t_warm, t_end] (see the module docstring)."""
    if t_end <= t_warm:
        return None
    productive = 0.0
    for segs in segments.values():
        for a, b, state in segs:
            a, b = max(a, t_warm), min(b, t_end)
            if b <= a:
                continue
            if state == Phase.TRAINING.value:
                productive += b - a
            elif state == Phase.STALLED.value:
                productive += min(median_s, b - a)
    return productive / (run.replicas * (t_end - t_warm))


def ettr_missing(run: Run, t_warm: float | None, committed_steps: int) -> str | None:
    """Why the run has no ETTR (None: it has one): a job that did not commit its last step did not
    finish, and its window would end at its last commit, hiding the time lost after it."""
    if committed_steps < run.steps:
        return f"the job did not finish ({committed_steps} of {run.steps} steps committed)"
    if t_warm is None:
        return "no warm-up: some replica never committed a step with its own batch"
    return None


def _recovery(run: Run, down: dict) -> float | None:
    """Seconds from a replica's death to its next rejoin (None: it never rejoined, or not a replica)."""
    if down[EVENT] != LauncherEvent.REPLICA_DOWN:
        return None
    back = next(
        (
            e
            for e in run.events
            if e[EVENT] == LauncherEvent.REJOINED and e[REPLICA] == down[REPLICA] and e[TIME] > down[TIME]
        ),
        None,
    )
    return round(back[TIME] - down[TIME], 3) if back else None


def partitions(run: Run) -> list[dict[str, Any]]:
    """What was committed while each `--partition` cut was in force (see the module docstring)."""
    out = []
    for cut in (e for e in run.events if e[EVENT] == LauncherEvent.FAULT and e.get("kind") == "partition"):
        r, host = cut[REPLICA], cut.get("host")
        end = next((e for e in run.events if e[EVENT] == LauncherEvent.PARTITION_ENDED and _same_window(cut, e)), None)
        t_cut, t_end = cut[TIME], end[TIME] if end else run.end

        def committed(o: int) -> list[dict]:
            return [s for s in _steps(run.metrics[o]) if s.get(StepField.COMMITTED)]

        before = max((s[StepField.STEP] for s in committed(r) if s[TIME] <= t_cut), default=0)
        during = [s for s in committed(r) if t_cut < s[TIME] <= t_end]
        # committed together with a peer (the same step in a quorum of the same size > 1): the
        # links went later than the cut record (cutting takes a while on a busy machine)
        shared = {
            (s[StepField.STEP], s.get(StepField.PARTICIPANTS))
            for o in range(run.replicas)
            if o != r
            for s in committed(o)
            if (s.get(StepField.PARTICIPANTS) or 0) > 1
        }
        alone = [s[StepField.STEP] for s in during if (s[StepField.STEP], s.get(StepField.PARTICIPANTS)) not in shared]
        back = next((e for e in run.metrics[r] if e.get(EVENT) == ReplicaEvent.CATCHUP_DONE and e[TIME] > t_end), None)
        out.append(
            {
                "replica": r,
                "host": host,
                "step": cut.get("step"),
                "seconds": cut.get("seconds"),
                "time_s": round(t_cut - run.start, 3),
                "restored": end is not None,
                "in_flight": [s[StepField.STEP] for s in during if s[StepField.STEP] == before + 1],
                "isolated_commits": [n for n in alone if n != before + 1],
                "peer_commits": {
                    str(o): sum(1 for s in committed(o) if t_cut < s[TIME] <= t_end)
                    for o in range(run.replicas)
                    if o != r
                },
                "rejoined_at_step": back.get("at_step") if back else None,
            }
        )
    return out


def divergences(run: Run) -> list[dict[str, Any]]:
    """Each `diverged` event of a replica: its digest and the kept one, the step, its source."""
    return [
        {
            "time_s": round(e[TIME] - run.start, 3),
            "replica": r,
            "step": e.get("step"),
            "digest": e.get("digest"),
            "majority_digest": e.get("majority_digest"),
            "source": e.get("source"),
        }
        for r in range(run.replicas)
        for e in run.metrics[r]
        if e.get(EVENT) == ReplicaEvent.DIVERGED
    ]


def exit_code(summary: dict[str, Any], code: int) -> tuple[int, str]:
    """The launcher's exit code given the supervisor's `code` (0: every replica finished), and why
    it is not 0: replicas that finished with different digests hold different models, a job the
    launcher stopped (its `error`) failed, a step committed in two lineages is two histories,
    whatever else went right, a batch trained twice or never breaks the job's data contract, and a
    job that did not commit its last step did not finish, even when every replica exited 0 (a
    script given to --entry may end without training). (A replica that ended behind a finished job
    holds an older state by design: it is left out.)"""
    final = {
        rid: rec["param_digest"]
        for rid, rec in summary["replicas"].items()
        if rec["param_digest"] and not rec.get("ended_behind")
    }
    if len(set(final.values())) > 1:
        return code or 1, "the replicas ended with different states: " + ", ".join(
            f"replica {rid} {d}" for rid, d in sorted(final.items())
        )
    if summary.get("error"):
        return code or 1, f"the run failed: {summary['error']}"
    if summary.get("split_history"):
        return code or 1, f"a split history: steps {summary['split_history']['steps'][:10]} were committed twice"
    if not summary["exactly_once"]:
        r, rec = next((r, rec) for r, rec in summary["replicas"].items() if not rec["exactly_once"])
        why = rec.get("exactly_once_error", "")  # (a constant batch's error too: each replica's record has it)
        return code or 1, f"not every batch was trained exactly once: replica {r}: {why}".rstrip(": ")
    if summary["committed_steps"] < summary["steps"]:  # (an --entry script that exited 0 without training)
        ended = ", though every replica exited 0" if code == 0 else ""
        return code or 1, f"the job committed {summary['committed_steps']} of its {summary['steps']} steps{ended}"
    return code, ""


def _same_window(cut: dict, end: dict) -> bool:
    """Whether `end` closes the window `cut` opened: the same number (overlapping windows of one
    replica end in any order), or in runs recorded before windows were numbered, the first end of
    the same replica and host after it."""
    if "cut" in cut:
        return end.get("cut") == cut["cut"]
    return end[REPLICA] == cut[REPLICA] and end.get("host") == cut.get("host") and end[TIME] >= cut[TIME]


def split_history(run: Run) -> dict[str, Any] | None:
    """The steps committed in two lineages (see the module docstring), None if there are none:
    {"steps": [...], "first": {"step": n, "commits": [{"quorum_id", "param_digest", "replicas"}]}}."""
    by_step: dict[int, dict[tuple[int, str], list[int]]] = {}
    for r in range(run.replicas):
        for s in _steps(run.metrics[r]):
            if s.get(StepField.COMMITTED) and s.get(StepField.PARAM_DIGEST) is not None:
                key = (int(s.get("quorum_id") or 0), s[StepField.PARAM_DIGEST])
                by_step.setdefault(int(s[StepField.STEP]), {}).setdefault(key, []).append(r)
    split = sorted(
        n for n, commits in by_step.items() if len({q for q, _ in commits}) > 1 and len({d for _, d in commits}) > 1
    )
    if not split:
        return None
    first = [
        {"quorum_id": q, "param_digest": d, "replicas": sorted(set(rs))}
        for (q, d), rs in sorted(by_step[split[0]].items())
    ]
    return {"steps": split, "first": {"step": split[0], "commits": first}}


def ended_behind(run: Run, r: int) -> bool:
    """Replica r's last word was `job_finished`: it ended behind a job that finished without it."""
    last = next(
        (rec for rec in reversed(run.metrics[r]) if rec.get(EVENT) in (ReplicaEvent.START, ReplicaEvent.JOB_FINISHED)),
        None,
    )
    return last is not None and last[EVENT] == ReplicaEvent.JOB_FINISHED


def final_loss(run: Run) -> float | None:
    k = max(1, run.steps // 20)
    losses = [
        s[StepField.LOSS]
        for r in range(run.replicas)
        for s in run.metrics[r]
        if is_own_step(s) and s.get(StepField.LOSS) is not None and s[StepField.STEP] > run.steps - k
    ]
    return statistics.fmean(losses) if losses else None


def _replica_summary(
    run: Run, r: int, segments: list[tuple[float, float, str]], constant: dict[str, Any] | None
) -> dict[str, Any]:
    """Replica r's entry of the summary's `replicas`."""
    steps = _steps(run.metrics[r])
    committed = [s for s in steps if s.get(StepField.COMMITTED)]
    final = run.finals.get(r) or {}
    catchups = [e for e in run.metrics[r] if e.get(EVENT) == ReplicaEvent.CATCHUP_DONE]
    once, why = exactly_once(run, r) if constant is None else (constant["exactly_once"], constant.get("error", ""))
    in_state = {phase.value: 0.0 for phase in Phase}
    for a, b, st in segments:
        in_state[st] += b - a
    return {
        "steps_committed": len(committed),
        "steps_contributed": sum(is_own_step(s) for s in steps),
        # the step of its state: its last commit, or a catch-up after it (one at the job's end commits none)
        "final_step": max([c[StepField.STEP] for c in committed] + [e.get("at_step") or 0 for e in catchups] + [0]),
        "restarts": sum(1 for e in run.events if e[EVENT] == LauncherEvent.REPLICA_STARTED and e[REPLICA] == r) - 1,
        "failures": sum(
            1 for e in run.events if _failed(e) and e[EVENT] == LauncherEvent.REPLICA_DOWN and e[REPLICA] == r
        ),
        "catchup_s": round(sum(e.get("catchup_s") or 0.0 for e in catchups), 3),
        "catchups": len(catchups),
        "param_digest": final.get("param_digest"),  # (not a step record's: another function of the state)
        "final_loss": final.get("final_loss"),
        "data_position": final_position(run, r),
        "finished": bool(final),
        "ended_behind": ended_behind(run, r),
        "exactly_once": once,
        **({"exactly_once_error": why} if why else {}),
        "seconds_in_state": {k: round(v, 3) for k, v in in_state.items()},
        "incarnations": (lives := incarnations(run, r)),
        "refusals": [{"incarnation": i["incarnation"], "reason": i["error"]} for i in lives if i["refused"]],
        "median_mfu": median_mfu(committed),
        "last_eval_loss": last_eval_loss(committed),
    }


def incarnations(run: Run, r: int) -> list[dict[str, Any]]:
    """Replica r's incarnations: how each ended and what it trained (see the module docstring)."""
    ends = [e for e in run.events if e.get(REPLICA) == r and e[EVENT] in (*DOWN_EVENTS, LauncherEvent.REPLICA_DONE)]
    out = []
    for number, inc in enumerate(run.incarnations(r), start=1):
        end = next((e for e in ends if e[TIME] == inc.end), None)  # (the event that ended it, if any)
        cause = {LauncherEvent.REPLICA_DONE: "done", "end": "running at the end"}.get(inc.ended_by, inc.ended_by)
        if end is not None and end[EVENT] == LauncherEvent.REPLICA_DOWN:
            cause = end.get("cause") or cause
        steps = _steps(inc.records)
        out.append(
            {
                "incarnation": number,
                "cause": cause,
                "error": (end or {}).get("error") or (end or {}).get("reason"),
                "refused": str(cause).startswith("refused"),
                "steps_contributed": sum(is_own_step(x) for x in steps),
                "steps_committed": sum(bool(x.get(StepField.COMMITTED)) for x in steps),
            }
        )
    return out


def last_eval_loss(steps: list[dict]) -> float | None:
    """The `eval_loss` of the latest step record that has one (None: no evaluation)."""
    return next((r["eval_loss"] for r in reversed(steps) if r.get("eval_loss") is not None), None)


def median_mfu(steps: list[dict]) -> float | None:
    """The median MFU of a replica's committed steps that carry one (None: no peak was known)."""
    values = [s[StepField.MFU] for s in steps if s.get(StepField.MFU) is not None]
    return round(statistics.median(values), 6) if values else None


def _failure_events(run: Run) -> list[dict[str, Any]]:
    """Every replica death and coordinator loss, with its recovery time."""
    return [
        {
            "time_s": round(e[TIME] - run.start, 3),
            "replica": e.get(REPLICA),
            "cause": e.get("cause"),
            "step": e.get("step"),
            **({"at": e["at"]} if e.get("at") else {}),
            "recovery_s": _recovery(run, e),
        }
        for e in run.events
        if e[EVENT] in (LauncherEvent.REPLICA_DOWN, LauncherEvent.COORDINATOR_DOWN) and _failed(e)
    ]


def _failed(e: dict) -> bool:
    """A down event that is a failure: not a reduced-degree replica leaving, as asked, to come back
    whole once its host is repaired (cause "left")."""
    return e.get("cause") != "left"


def _rejoins(run: Run) -> list[dict[str, Any]]:
    """Every rejoin of a replica: when, at which step, after how long a catch-up."""
    return [
        {
            "time_s": round(e[TIME] - run.start, 3),
            "replica": e[REPLICA],
            "at_step": e.get("at_step"),
            "catchup_s": e.get("catchup_s"),
        }
        for e in run.events
        if e[EVENT] == LauncherEvent.REJOINED
    ]


# --- the summary ----------------------------------------------------------------------------------
def build_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary of a run directory (see the module docstring for every definition)."""
    run = load_run(run_dir)
    t_warm = warm_time(run)
    median_s, healthy = median_step(run, t_warm)
    committed_times = [
        s[TIME] for r in range(run.replicas) for s in _steps(run.metrics[r]) if s.get(StepField.COMMITTED)
    ]
    t_end = max(committed_times) if committed_times else run.end
    segments = timeline(run, median_s)
    constant = constant_batch(run)

    replicas = {str(r): _replica_summary(run, r, segments[r], constant) for r in range(run.replicas)}
    failure_events = _failure_events(run)
    digests = [rec["param_digest"] for rec in replicas.values() if not rec["ended_behind"]]
    split = split_history(run)
    committed_steps = max((rec["final_step"] for rec in replicas.values()), default=0)
    ettr_why = ettr_missing(run, t_warm, committed_steps)
    ettr_value = (
        ettr(run, segments, t_warm, t_end, median_s or 0.0) if ettr_why is None and t_warm is not None else None
    )
    loss = final_loss(run)
    end_event = next((e for e in reversed(run.events) if e[EVENT] == LauncherEvent.END), None)
    once = all(rec["exactly_once"] for rec in replicas.values())
    return {
        "config": run.launch.get("config"),
        "overrides": run.launch.get("overrides"),
        "replicas_count": run.replicas,
        "hosts_per_replica": run.launch.get("hosts"),
        "devices_per_host": run.launch.get("devices"),
        "steps": run.steps,
        "replicas": replicas,
        # (every replica exiting 0 is not enough: an --entry script may end without training)
        "ok": bool(end_event and end_event.get("ok")) and split is None and committed_steps >= run.steps and once,
        "split_history": split,
        "wall_s": round((end_event or {TIME: run.end})[TIME] - run.start, 3),
        "warmup_s": round(t_warm - run.start, 3) if t_warm is not None else None,
        "committed_steps": committed_steps,
        "error": (end_event or {}).get("error"),
        "failures": len(failure_events),
        "failure_events": failure_events,
        "rejoins": _rejoins(run),
        "partitions": partitions(run),
        "ettr": round(ettr_value, 4) if ettr_value is not None else None,
        **({"ettr_why": ettr_why} if ettr_why else {}),
        "median_step_s": round(median_s, 4) if median_s is not None else None,
        "max_healthy_stall_s": round(max(stall for _, _, stall in healthy), 4) if healthy else None,
        "max_healthy_gap_s": round(max(gap for _, gap, _ in healthy), 4) if healthy else None,
        "max_healthy_wait_s": max_healthy_wait(run, t_warm),
        "final_loss": round(loss, 5) if loss is not None else None,
        "digests_equal": len(set(digests)) == 1 and None not in digests,
        "digests_missing": [
            rid for rid, rec in replicas.items() if rec["param_digest"] is None and not rec["ended_behind"]
        ],
        "exactly_once": once,
        "divergences": divergences(run),
        **({"constant_batch": constant} if constant is not None else {}),
    }


def write_summary(run_dir: str | Path) -> dict[str, Any]:
    """Build the summary and write it to RUN/summary.json."""
    summary = build_summary(run_dir)
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
