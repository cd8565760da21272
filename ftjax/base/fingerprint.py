"""The topology fingerprint: a short sha256 of a replica's layout text (ftjax/program/step.py
writes the text; the coordinator compares fingerprints, ftjax/coordinator/layout.py the texts)."""

from __future__ import annotations

import hashlib


def fingerprint(layout: str) -> str:
    """The topology fingerprint of a layout text: a short hash (replicas that average together match)."""
    return hashlib.sha256(layout.encode()).hexdigest()[:16]
