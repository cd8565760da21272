"""FTAR's exceptions. Every failure of a call is one of these, and names the peer held responsible,
so that the caller (the replica's manager) can report it to the coordinator and retry under a new
quorum."""

from __future__ import annotations


class FTARError(RuntimeError):
    """An all-reduce that did not complete. The output buffer's contents are then unspecified."""

    kind = "failed"  # the word carried in abort notices (see endpoint.py)

    def __init__(self, message: str, *, peer: str, quorum_id: int, step: int) -> None:
        super().__init__(f"FTAR quorum {quorum_id} step {step}: peer {peer}: {message}")
        self.peer = peer
        self.quorum_id = quorum_id
        self.step = step
        self.detail = message


class PeerFailed(FTARError):
    """The peer's connection closed, was reset or refused: its process is gone (or it aborted)."""

    kind = "failed"


class PeerTimeout(FTARError):
    """No progress with the peer within the endpoint's ``timeout_s``: it hangs or is unreachable."""

    kind = "timeout"


class ProtocolError(FTARError):
    """The peer sent a frame that does not belong to this call (another quorum, step, member list,
    length) or that is garbled (bad magic, checksum). The call raises instead of using it."""

    kind = "protocol"


class HandshakeRefused(FTARError):
    """The peer's listener refused our connection: wrong job token, or a quorum it has left behind."""

    kind = "refused"
