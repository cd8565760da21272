"""The job's coordinator: membership, heartbeats and per-step quorums over gRPC.

Public API (imported lazily, so that `import coordinator` stays cheap):
    CoordinatorClient, MemberInfo, QuorumResult, CoordinatorError, new_incarnation  (client side)
    CoordinatorServer, Settings                                                     (server side)
    compute_quorum, Quorum, Participant                                             (the pure rules)
"""

TOKEN_METADATA_KEY = "x-ftjax-token"  # call metadata carrying the job's shared secret

_EXPORTS = {
    "CoordinatorClient": "coordinator.client",
    "CoordinatorError": "coordinator.client",
    "MemberInfo": "coordinator.client",
    "QuorumResult": "coordinator.client",
    "new_incarnation": "coordinator.client",
    "CoordinatorServer": "coordinator.server",
    "Settings": "coordinator.quorum",
    "compute_quorum": "coordinator.quorum",
    "Quorum": "coordinator.quorum",
    "Participant": "coordinator.quorum",
}

__all__ = ["TOKEN_METADATA_KEY", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
