"""A quorum as the coordinator's `QuorumResponse` message, built once for all its participants.

The coordinator answers each participant with these bytes (ftjax/coordinator/server.py), and a
replica's leader hands the quorum it received to its other hosts as the same message
(`encode_quorum` in ftjax/coordinator/client.py): one encoder for both. Each participant's answer is
the common bytes followed by a few bytes of its own (protobuf merges concatenated messages), and
the static membership only when the participant does not hold it yet.
"""

from __future__ import annotations

from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator.quorum import Quorum


class QuorumEncoding:
    """One quorum's answer, serialized once for all of its participants. `q` is a coordinator
    `Quorum`, or a replica's `QuorumResult` (the same fields and participants)."""

    def __init__(self, q: Quorum) -> None:
        self.q = q
        self._index = index = {p.replica_id: i for i, p in enumerate(q.participants)}
        parts = q.participants
        uniform = all(p.step == q.step for p in parts)
        healing = any(p.healing for p in parts)
        self._common = pb.QuorumResponse(
            quorum_id=q.quorum_id, step=q.step, no_state=q.no_state, num_contributors=q.num_contributors,
            num_participants=len(parts),
            steps=None if uniform else [p.step for p in parts],
            data_positions=[p.data_position for p in parts],
            heal_sources=[index[p.heal_source] + 1 if p.healing else 0 for p in parts] if healing else None,
        ).SerializeToString()
        self._members: bytes | None = None

    def _membership(self) -> bytes:
        if self._members is None:
            self._members = pb.QuorumResponse(members=[
                pb.MemberAddress(replica_id=p.replica_id, incarnation=p.incarnation,
                                 ftar_addresses=p.ftar_addresses, catchup_addresses=p.catchup_addresses)
                for p in self.q.participants
            ]).SerializeToString()
        return self._members

    def rank(self, replica_id: str) -> int | None:
        return self._index.get(replica_id)

    def for_member(self, rank: int, known_quorum_id: int) -> bytes:
        p = self.q.participants[rank]
        if p.healing:
            source = self.q.participants[self._index[p.heal_source]]
            own = pb.QuorumResponse(rank=rank, healing=True, heal_source=p.heal_source,
                                    heal_source_addresses=source.catchup_addresses, data_position=p.data_position,
                                    majority_digest=self.q.diverged.get(p.replica_id, ""))
        else:
            own = pb.QuorumResponse(rank=rank, data_position=p.data_position)
        own = own.SerializeToString()
        if known_quorum_id == self.q.quorum_id:
            return self._common + own
        return self._common + self._membership() + own
