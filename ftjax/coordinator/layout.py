"""What differs between two replicas' layouts, for the coordinator's refusal of a mismatched member.

A replica's topology fingerprint (ftjax/base/fingerprint.py) hashes its layout text
(`ReplicaProgram.topology`, ftjax/program/step.py): one `key: value` line per item, the mesh's lanes
first, then each state leaf's path, shape, dtype and partition spec. Two hashes only say *that*
replicas differ; the texts (sent once per heartbeat stream) say *where*: `d_model=128` against 64
names the leaves whose shapes changed.
"""

from __future__ import annotations

MAX_LAYOUT_BYTES = 256 * 1024  # a layout text the coordinator accepts (a few KB for the models here)
SHOWN = 4  # differing items named in a refusal


def parse(layout: str) -> dict[str, str]:
    """`key: value` lines -> {key: value} (a line without ': ' is its own key, with an empty value)."""
    items: dict[str, str] = {}
    for line in layout.splitlines():
        key, _, value = line.partition(": ")
        items[key] = value
    return items


def layout_difference(job: str | None, member: str | None) -> str:
    """'; differing: ...' naming up to SHOWN items whose values differ (or that only one side has),
    job's value first; '' when either text is unknown."""
    if not job or not member:
        return ""
    a, b = parse(job), parse(member)
    keys = [k for k in a if a[k] != b.get(k)] + [k for k in b if k not in a]
    if not keys:
        return ""
    shown = [f"{k} (job: {a.get(k, 'absent')}; this replica: {b.get(k, 'absent')})" for k in keys[:SHOWN]]
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"; {len(keys)} items differ: " + ", ".join(shown) + more
