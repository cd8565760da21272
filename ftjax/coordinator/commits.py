"""Commit decisions made by the coordinator (`ft.commit_decision: coordinator`; docs/design/step.md,
"One history", "A commit the coordinator decides").

FTAR's confirmation ring tells a member that every member's data ring completed, but the
confirmation's own last frame can be lost: a member whose confirmation completed commits while a
peer whose last frame a cut swallowed retries the step without it (the two generals). Here a step
commits only if the coordinator says so, and it says so once every participant of the step's quorum
voted that its average succeeded. One decision per quorum formation (a retried step with the same
members has the same quorum id and step, but is a new formation), never changed:

- COMMIT: every participant voted yes. From then on the job has committed the step (the caller
  raises its committed step and moves the contributors' data positions past their batches), so a
  participant that did not hear the answer is behind and heals: it never trains the step again.
- ABORT: a participant voted no, left the job, or did not vote before the deadline that the first
  vote set; or a newer quorum formed. Nobody commits the step; every participant retries it.
- UNKNOWN (not stored): the formation is not the current quorum's and no decision of it is kept
  (a restarted coordinator, or one so old it was forgotten). The member does not commit; if a peer
  did, the next quorum finds the member behind and it heals.

A member commits only on COMMIT. Pure: the caller holds the lock and supplies the time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ftjax.coordinator.quorum import Quorum

COMMIT, ABORT, UNKNOWN, PENDING = "COMMIT", "ABORT", "UNKNOWN", "PENDING"
KEEP = 256  # decisions kept for late or repeated votes (a few steps' worth is plenty)


class NotAParticipant(ValueError):
    """The vote's replica (or incarnation) is not a participant of the quorum it names, or names
    another quorum id or step than that formation's."""


@dataclass
class _Open:
    quorum: Quorum
    deadline: float
    yes: set[str] = field(default_factory=set)


class CommitBook:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.decided: OrderedDict[int, tuple[str, str]] = OrderedDict()  # formation -> (COMMIT | ABORT, why)
        self.open: dict[int, _Open] = {}
        self.counts = {COMMIT: 0, ABORT: 0}
        self.fresh: list[int] = []  # decided since the caller last took them (`take_fresh`)

    def vote(
        self,
        quorum: Quorum | None,
        formation: int,
        step: tuple[int, int],
        member: tuple[str, str],
        ok: bool,
        deadline: float,
        reason: str = "",
    ) -> tuple[str, str]:
        """Record the vote of `member` (replica id, incarnation) on `step` (quorum id, step) of the
        quorum formation `formation`, the current one being `quorum`. Returns (COMMIT or ABORT, why)
        once decided, PENDING while others have not voted, or UNKNOWN. `deadline`: when the step
        aborts unless decided (its first vote sets it)."""
        if formation in self.decided:
            return self.decided[formation]
        if quorum is None or quorum.formation != formation:
            return UNKNOWN, f"no record of quorum formation {formation} (the coordinator restarted, or it is too old)"
        if step != (quorum.quorum_id, quorum.step) or member not in quorum.members:
            raise NotAParticipant(
                f"replica {member[0]} (incarnation {member[1]}) voted on quorum {step[0]} step {step[1]}, but "
                f"formation {formation} is quorum {quorum.quorum_id} at step {quorum.step} of "
                f"{', '.join(f'{r} ({i})' for r, i in quorum.members)}"
            )
        entry = self.open.setdefault(formation, _Open(quorum, deadline))
        if not ok:
            return self._decide(formation, ABORT, f"replica {member[0]} voted no: {reason}"[:300])
        entry.yes.add(member[0])
        if len(entry.yes) == len(quorum.participants):
            return self._decide(formation, COMMIT, f"all {len(entry.yes)} participants voted yes")
        return PENDING, f"{len(entry.yes)} of {len(quorum.participants)} participants voted yes"

    def expire(self, now: float) -> None:
        """Abort every open formation whose deadline passed."""
        for f, e in list(self.open.items()):
            if e.deadline <= now:
                waiting = sorted(p.replica_id for p in e.quorum.participants if p.replica_id not in e.yes)
                self._decide(f, ABORT, f"no vote from {', '.join(waiting)} before the deadline")

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self.open.values()), default=None)

    def departed(self, replica_id: str, why: str) -> None:
        """A participant left the job (dead, or replaced): the open formations it has not voted yes
        on cannot all vote yes any more, so they abort now rather than at their deadline."""
        for f, e in list(self.open.items()):
            if replica_id not in e.yes and any(p.replica_id == replica_id for p in e.quorum.participants):
                self._decide(f, ABORT, f"replica {replica_id} left the job before it voted ({why})")

    def superseded(self, formation: int) -> None:
        """A quorum formed: an open formation before it can no longer gather its votes (its
        participants asked for a new quorum, so none of them will vote on it again); it aborts."""
        for f in [f for f in self.open if f != formation]:
            self._decide(f, ABORT, f"a newer quorum (formation {formation}) formed before every participant voted")

    def take_fresh(self) -> list[tuple[int, tuple[str, str]]]:
        """The formations decided since the last call, with their decisions (whose waiters to answer)."""
        fresh, self.fresh = self.fresh, []
        return [(f, self.decided[f]) for f in fresh if f in self.decided]

    def _decide(self, formation: int, decision: str, why: str) -> tuple[str, str]:
        self.open.pop(formation, None)
        self.decided[formation] = (decision, why)
        self.counts[decision] += 1
        self.fresh.append(formation)
        while len(self.decided) > self.keep:
            self.decided.popitem(last=False)
        return decision, why
