"""The coordinator's vocabulary on the replica's side, free of gRPC: what a replica tells the
coordinator about itself (`MemberInfo`), what it learns from it (`QuorumResult`), and how a job
ends for a replica left behind (`JobFinished`). The runtime imports these without the transport
(ftjax/coordinator/client.py); the wire form of a quorum is in ftjax/coordinator/codec.py."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftjax.coordinator.quorum import MemberReport, Participant

if TYPE_CHECKING:
    import grpc


def new_incarnation() -> str:
    """A fresh incarnation id for this process start."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


class CoordinatorError(RuntimeError):
    """The coordinator refused a request, or could not be reached in time. `code` is the gRPC status
    (a grpc.StatusCode; this module only reads its name, so it imports no gRPC)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class JobFinished(Exception):
    """The job finished at `step`, and no live replica holds its state: this replica, behind it,
    has nothing left to train (training finished steps again would make a second history)."""

    def __init__(self, step: int, replica_id: str, at_step: int) -> None:
        super().__init__(
            f"the job finished at step {step}; replica {replica_id} is at step {at_step} and no live "
            "replica holds the final state: nothing left to train"
        )
        self.step = step


@dataclass(frozen=True)
class MemberInfo:
    """A replica leader's static fields: fixed for the life of its process."""

    replica_id: str
    incarnation: str
    num_hosts: int  # the hosts it runs on now (fewer than the job's in a reduced-degree replica)
    ftar_addresses: tuple[str, ...]  # one per gradient lane (ftjax/runtime/lanes.py): the job's mesh.hosts
    catchup_addresses: tuple[str, ...]  # one per host rank: where host h serves its part of the state
    topology_fingerprint: str
    topology: str = ""  # the layout text hashed into the fingerprint (ftjax/coordinator/layout.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ftar_addresses", tuple(self.ftar_addresses))
        object.__setattr__(self, "catchup_addresses", tuple(self.catchup_addresses))
        if len(self.catchup_addresses) != self.num_hosts or len(self.ftar_addresses) % self.num_hosts:
            raise ValueError(
                f"{len(self.catchup_addresses)} catch-up and {len(self.ftar_addresses)} FTAR addresses for "
                f"num_hosts={self.num_hosts} (one per host; one per lane, a multiple of the hosts)"
            )
        MemberReport(
            self.replica_id,
            self.incarnation,
            ftar_addresses=self.ftar_addresses,
            catchup_addresses=self.catchup_addresses,
            topology_fingerprint=self.topology_fingerprint,
        ).validate("member_info")


@dataclass(frozen=True)
class QuorumResult:
    """One step's quorum, as this replica sees it."""

    quorum_id: int
    step: int  # the max step among participants with state
    participants: tuple[Participant, ...]  # ordered by replica_id
    rank: int  # this replica's index in participants
    healing: bool  # this replica must fetch the state of `step` from heal_source
    heal_source: str
    heal_source_addresses: tuple[str, ...]  # the source's catch-up address per host rank
    num_contributors: int  # participants not healing: the divisor of the gradient average
    data_position: int  # where this replica's data stream resumes
    no_state: bool  # nobody has state: restore the latest durable checkpoint
    majority_digest: str = ""  # set: this replica's state diverged from it; it heals from heal_source
    formation: int = 0  # the coordinator's number of this formation (what a commit vote names; 0: none)

    @property
    def diverged(self) -> dict[str, str]:
        """As the coordinator's Quorum has it (replica_id -> the digest kept), for this replica only."""
        return {self.participants[self.rank].replica_id: self.majority_digest} if self.majority_digest else {}

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(p.replica_id for p in self.participants)

    @property
    def heal_targets(self) -> tuple[Participant, ...]:
        """The participants that heal from this replica (it must serve them its state)."""
        me = self.participants[self.rank].replica_id
        return tuple(p for p in self.participants if p.healing and p.heal_source == me)
