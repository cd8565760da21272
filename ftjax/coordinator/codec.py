"""A quorum as the coordinator's `QuorumResponse` message, built once for all its participants.

The coordinator answers each participant with these bytes (ftjax/coordinator/server.py), and a
replica's leader hands the quorum it received to its other hosts as the same message
(`encode_quorum`, below): one encoder for both. Each participant's answer is
the common bytes followed by a few bytes of its own (protobuf merges concatenated messages), and
the static membership only when the participant does not hold it yet.
"""

from __future__ import annotations

from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.quorum import Participant, Quorum
from ftjax.coordinator.types import QuorumResult


class QuorumEncoding:
    """One quorum's answer, serialized once for all of its participants. `q` is a coordinator
    `Quorum`, or a replica's `QuorumResult` (the same fields and participants)."""

    def __init__(self, q: Quorum | QuorumResult) -> None:
        self.q = q
        self._index = index = {p.replica_id: i for i, p in enumerate(q.participants)}
        parts = q.participants
        uniform = all(p.step == q.step for p in parts)
        healing = any(p.healing for p in parts)
        self._common = pb.QuorumResponse(
            quorum_id=q.quorum_id,
            step=q.step,
            no_state=q.no_state,
            num_contributors=q.num_contributors,
            num_participants=len(parts),
            steps=None if uniform else [p.step for p in parts],
            data_positions=[p.data_position for p in parts],
            heal_sources=[index[p.heal_source] + 1 if p.healing else 0 for p in parts] if healing else None,
            formation=q.formation,
        ).SerializeToString()
        self._members: bytes | None = None

    def _membership(self) -> bytes:
        if self._members is None:
            self._members = pb.QuorumResponse(
                members=[
                    pb.MemberAddress(
                        replica_id=p.replica_id,
                        incarnation=p.incarnation,
                        ftar_addresses=p.ftar_addresses,
                        catchup_addresses=p.catchup_addresses,
                    )
                    for p in self.q.participants
                ]
            ).SerializeToString()
        return self._members

    def rank(self, replica_id: str) -> int | None:
        return self._index.get(replica_id)

    def for_member(self, rank: int, known_quorum_id: int) -> bytes:
        p = self.q.participants[rank]
        if p.healing:
            source = self.q.participants[self._index[p.heal_source]]
            own = pb.QuorumResponse(
                rank=rank,
                healing=True,
                heal_source=p.heal_source,
                heal_source_addresses=source.catchup_addresses,
                data_position=p.data_position,
                majority_digest=self.q.diverged.get(p.replica_id, ""),
            )
        else:
            own = pb.QuorumResponse(rank=rank, data_position=p.data_position)
        if known_quorum_id == self.q.quorum_id:
            return self._common + own.SerializeToString()
        return self._common + self._membership() + own.SerializeToString()


def result_from_proto(r: pb.QuorumResponse, members: tuple[pb.MemberAddress, ...]) -> QuorumResult:
    """Join a response's per-participant columns with the quorum's static membership."""
    n = r.num_participants
    steps = r.steps or [r.step] * n  # empty: everybody at the quorum's step
    sources = r.heal_sources or [0] * n  # empty: nobody heals
    if not (len(members) == len(steps) == len(r.data_positions) == len(sources) == n) or not 0 <= r.rank < n:
        raise ValueError(f"malformed quorum {r.quorum_id}: inconsistent columns")
    participants = tuple(
        Participant(
            replica_id=m.replica_id,
            incarnation=m.incarnation,
            step=steps[i],
            data_position=r.data_positions[i],
            ftar_addresses=tuple(m.ftar_addresses),
            catchup_addresses=tuple(m.catchup_addresses),
            healing=sources[i] > 0,
            heal_source=members[sources[i] - 1].replica_id if sources[i] > 0 else "",
        )
        for i, m in enumerate(members)
    )
    return QuorumResult(
        quorum_id=r.quorum_id,
        step=r.step,
        participants=participants,
        rank=r.rank,
        healing=r.healing,
        heal_source=r.heal_source,
        heal_source_addresses=tuple(r.heal_source_addresses),
        num_contributors=r.num_contributors,
        data_position=r.data_position,
        no_state=r.no_state,
        majority_digest=r.majority_digest,
        formation=r.formation,
    )


def encode_quorum(q: QuorumResult) -> bytes:
    """A quorum as this replica sees it, as the coordinator's own message (membership included):
    what a replica's leader hands its other hosts. `decode_quorum` is its inverse."""
    return QuorumEncoding(q).for_member(q.rank, known_quorum_id=0)  # (0: holds no membership yet)


def decode_quorum(data: bytes) -> QuorumResult:
    r = pb.QuorumResponse.FromString(data)
    return result_from_proto(r, tuple(r.members))
