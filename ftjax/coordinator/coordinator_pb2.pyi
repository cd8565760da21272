from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("replica_id", "incarnation", "step", "data_position", "has_state", "num_hosts", "ftar_addresses", "catchup_addresses", "topology_fingerprint", "commit_failures", "digest")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    FTAR_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation: str
    step: int
    data_position: int
    has_state: bool
    num_hosts: int
    ftar_addresses: _containers.RepeatedScalarFieldContainer[str]
    catchup_addresses: _containers.RepeatedScalarFieldContainer[str]
    topology_fingerprint: str
    commit_failures: int
    digest: str
    def __init__(self, replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., step: _Optional[int] = ..., data_position: _Optional[int] = ..., has_state: _Optional[bool] = ..., num_hosts: _Optional[int] = ..., ftar_addresses: _Optional[_Iterable[str]] = ..., catchup_addresses: _Optional[_Iterable[str]] = ..., topology_fingerprint: _Optional[str] = ..., commit_failures: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ReplicaPosition(_message.Message):
    __slots__ = ("replica_id", "data_position")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    data_position: int
    def __init__(self, replica_id: _Optional[str] = ..., data_position: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member", "known_positions", "topology")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    member: Member
    known_positions: _containers.RepeatedCompositeFieldContainer[ReplicaPosition]
    topology: str
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ..., known_positions: _Optional[_Iterable[_Union[ReplicaPosition, _Mapping]]] = ..., topology: _Optional[str] = ...) -> None: ...

class HeartbeatSummary(_message.Message):
    __slots__ = ("heartbeats",)
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    heartbeats: int
    def __init__(self, heartbeats: _Optional[int] = ...) -> None: ...

class QuorumRequest(_message.Message):
    __slots__ = ("member", "timeout_ms", "known_quorum_id", "report")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    member: Member
    timeout_ms: int
    known_quorum_id: int
    report: StepReport
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., known_quorum_id: _Optional[int] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "committed", "contributed", "loss", "step_time_s", "tokens", "target_steps", "replicas", "mfu", "eval_loss", "inner_steps", "fragment", "sync_bytes", "catchup_bytes_done", "catchup_bytes_total", "catchup_eta_s", "warmup_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_BYTES_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_ETA_S_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed: bool
    contributed: bool
    loss: float
    step_time_s: float
    tokens: int
    target_steps: int
    replicas: int
    mfu: float
    eval_loss: float
    inner_steps: int
    fragment: int
    sync_bytes: int
    catchup_bytes_done: int
    catchup_bytes_total: int
    catchup_eta_s: float
    warmup_steps: int
    def __init__(self, step: _Optional[int] = ..., committed: _Optional[bool] = ..., contributed: _Optional[bool] = ..., loss: _Optional[float] = ..., step_time_s: _Optional[float] = ..., tokens: _Optional[int] = ..., target_steps: _Optional[int] = ..., replicas: _Optional[int] = ..., mfu: _Optional[float] = ..., eval_loss: _Optional[float] = ..., inner_steps: _Optional[int] = ..., fragment: _Optional[int] = ..., sync_bytes: _Optional[int] = ..., catchup_bytes_done: _Optional[int] = ..., catchup_bytes_total: _Optional[int] = ..., catchup_eta_s: _Optional[float] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class MemberAddress(_message.Message):
    __slots__ = ("replica_id", "incarnation", "ftar_addresses", "catchup_addresses")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FTAR_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation: str
    ftar_addresses: _containers.RepeatedScalarFieldContainer[str]
    catchup_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., ftar_addresses: _Optional[_Iterable[str]] = ..., catchup_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class QuorumResponse(_message.Message):
    __slots__ = ("quorum_id", "step", "no_state", "num_contributors", "num_participants", "members", "steps", "data_positions", "heal_sources", "rank", "healing", "heal_source", "heal_source_addresses", "data_position", "majority_digest", "formation", "finished_step")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NO_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HEAL_SOURCES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HEALING_FIELD_NUMBER: _ClassVar[int]
    HEAL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HEAL_SOURCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    MAJORITY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FORMATION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEP_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    step: int
    no_state: bool
    num_contributors: int
    num_participants: int
    members: _containers.RepeatedCompositeFieldContainer[MemberAddress]
    steps: _containers.RepeatedScalarFieldContainer[int]
    data_positions: _containers.RepeatedScalarFieldContainer[int]
    heal_sources: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    healing: bool
    heal_source: str
    heal_source_addresses: _containers.RepeatedScalarFieldContainer[str]
    data_position: int
    majority_digest: str
    formation: int
    finished_step: int
    def __init__(self, quorum_id: _Optional[int] = ..., step: _Optional[int] = ..., no_state: _Optional[bool] = ..., num_contributors: _Optional[int] = ..., num_participants: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberAddress, _Mapping]]] = ..., steps: _Optional[_Iterable[int]] = ..., data_positions: _Optional[_Iterable[int]] = ..., heal_sources: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., healing: _Optional[bool] = ..., heal_source: _Optional[str] = ..., heal_source_addresses: _Optional[_Iterable[str]] = ..., data_position: _Optional[int] = ..., majority_digest: _Optional[str] = ..., formation: _Optional[int] = ..., finished_step: _Optional[int] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("quorum_id", "replica_id", "incarnation", "reason", "reporter_id")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    replica_id: str
    incarnation: str
    reason: str
    reporter_id: str
    def __init__(self, quorum_id: _Optional[int] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., reason: _Optional[str] = ..., reporter_id: _Optional[str] = ...) -> None: ...

class FailureVerdict(_message.Message):
    __slots__ = ("dropped", "verdict", "detail")
    class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VERDICT_UNSPECIFIED: _ClassVar[FailureVerdict.Verdict]
        DROPPED: _ClassVar[FailureVerdict.Verdict]
        ALREADY_GONE: _ClassVar[FailureVerdict.Verdict]
        ALIVE: _ClassVar[FailureVerdict.Verdict]
        STALE_INCARNATION: _ClassVar[FailureVerdict.Verdict]
        UNKNOWN_REPLICA: _ClassVar[FailureVerdict.Verdict]
        SUSPECT: _ClassVar[FailureVerdict.Verdict]
    VERDICT_UNSPECIFIED: FailureVerdict.Verdict
    DROPPED: FailureVerdict.Verdict
    ALREADY_GONE: FailureVerdict.Verdict
    ALIVE: FailureVerdict.Verdict
    STALE_INCARNATION: FailureVerdict.Verdict
    UNKNOWN_REPLICA: FailureVerdict.Verdict
    SUSPECT: FailureVerdict.Verdict
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    verdict: FailureVerdict.Verdict
    detail: str
    def __init__(self, dropped: _Optional[bool] = ..., verdict: _Optional[_Union[FailureVerdict.Verdict, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class CommitVote(_message.Message):
    __slots__ = ("formation", "quorum_id", "step", "replica_id", "incarnation", "ok", "reason", "timeout_ms")
    FORMATION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    formation: int
    quorum_id: int
    step: int
    replica_id: str
    incarnation: str
    ok: bool
    reason: str
    timeout_ms: int
    def __init__(self, formation: _Optional[int] = ..., quorum_id: _Optional[int] = ..., step: _Optional[int] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CommitDecision(_message.Message):
    __slots__ = ("decision", "detail")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    decision: str
    detail: str
    def __init__(self, decision: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
