"""FTAR: fault-tolerant ring all-reduce of host buffers between the replicas of a quorum.

    ep = FTAREndpoint(token, timeout_s=30)
    avg = ep.allreduce(grads, quorum_id=q, step=n, members=addresses, rank=i, contributors=flags)

See endpoint.py (membership, links, failures), ring.py (the algorithm), wire.py (frames, handshake),
shm.py (same-host links: payloads through shared memory).
"""

from ftjax.ftar.endpoint import FTAREndpoint
from ftjax.ftar.errors import FTARError, HandshakeRefused, PeerFailed, PeerTimeout, ProtocolError

__all__ = ["FTAREndpoint", "FTARError", "HandshakeRefused", "PeerFailed", "PeerTimeout", "ProtocolError"]
