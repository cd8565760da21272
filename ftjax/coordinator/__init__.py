"""The job's coordinator: membership, heartbeats and per-step quorums over gRPC.

Public API (imported lazily, so that `import ftjax.coordinator` stays cheap):
    CoordinatorClient, MemberInfo, QuorumResult, CoordinatorError, new_incarnation  (client side)
    CoordinatorServer, Settings                                                     (server side)
    compute_quorum, Quorum, Participant                                             (the pure rules)
"""

TOKEN_METADATA_KEY = "x-ftjax-token"  # call metadata carrying the job's shared secret

_EXPORTS = {
    "CoordinatorClient": "ftjax.coordinator.client",
    "CoordinatorError": "ftjax.coordinator.types",
    "MemberInfo": "ftjax.coordinator.types",
    "QuorumResult": "ftjax.coordinator.types",
    "new_incarnation": "ftjax.coordinator.types",
    "CoordinatorServer": "ftjax.coordinator.server",
    "Settings": "ftjax.coordinator.quorum",
    "compute_quorum": "ftjax.coordinator.quorum",
    "Quorum": "ftjax.coordinator.quorum",
    "Participant": "ftjax.coordinator.quorum",
}

__all__ = [  # noqa: RUF022 (grouped as above)
    "TOKEN_METADATA_KEY",
    "CoordinatorClient",
    "CoordinatorError",
    "MemberInfo",
    "QuorumResult",
    "new_incarnation",
    "CoordinatorServer",
    "Settings",
    "compute_quorum",
    "Quorum",
    "Participant",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ftjax.coordinator' has no attribute {name!r}")
