"""Constant global batch: which rows of a step's R batches each contributor computes.

In `ft.global_batch: constant` mode, step n always trains the same R batches of the job's data:
batch n of stream r, for every stream r in 0..R-1 (stream r is replica r's data), whoever is
alive. A contributor computes its own stream's batch. The batches of streams whose replica does not
contribute to the step (missing or healing) are cut into micro-batches of `unit` rows and dealt
out among the contributors, in stream order, as evenly as the units allow. So during an outage each
contributor computes about R / C batches (C contributors), not two. (docs/design/index.md, "Constant
global batch".)

`assign` is a pure function of the quorum, so every member knows the whole step's assignment
before the step, and it is recorded with each step, whoever computed what.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

RowSpan = tuple[int, int, int]  # (stream, first row, end row) of that stream's batch of the step


def assign(
    streams: int, rows: int, unit: int, contributors: Sequence[int], own_rows: Mapping[int, int] | None = None
) -> dict[int, tuple[RowSpan, ...]]:
    """For each contributor (a stream id: replica r contributes stream r), the spans of the step's
    batches it computes. Its own batch comes first: whole, or for a reduced-degree replica the first
    `own_rows[c]` rows (its share, in proportion to its devices). Then the `unit`-row micro-batches
    nobody owns (the batches of the streams that do not contribute, the rest of a reduced replica's
    batch), in stream and row order, dealt out in consecutive runs, contributor after contributor,
    in counts that even out the work per device: each unit in turn goes to the contributor that
    would then have the fewest rows per unit of capacity (its own rows / `rows`), ties to the lower
    id. With full replicas only, the first `U mod C` contributors (by id) take `U // C + 1` units,
    the others `U // C` (U units in all, C contributors).

    Raises ValueError naming the argument at fault."""
    if streams < 1 or rows < 1:
        raise ValueError(f"streams ({streams}) and rows ({rows}) must be positive")
    if unit < 1 or rows % unit:
        raise ValueError(f"unit: {unit} rows do not divide a batch of {rows}")
    cs = sorted(set(contributors))
    if not cs:
        raise ValueError("contributors: none (a step needs one at least)")
    if cs[0] < 0 or cs[-1] >= streams:
        raise ValueError(f"contributors: {cs} are not all streams of 0..{streams - 1}")
    own = {c: rows if own_rows is None else own_rows.get(c, rows) for c in cs}
    for c, n in own.items():
        if not 0 < n <= rows or n % unit:
            raise ValueError(
                f"own_rows: contributor {c} computes {n} rows of its batch of {rows}: "
                f"not a positive multiple of the unit ({unit} rows)"
            )
    units = [(s, a) for s in range(streams) for a in range(0, rows, unit) if s not in cs or a >= own[s]]
    load = dict(own)
    counts = dict.fromkeys(cs, 0)
    for _ in units:  # the counts only: who takes which units follows, in runs
        c = min(cs, key=lambda c: ((load[c] + unit) * rows / own[c], c))
        load[c] += unit
        counts[c] += 1
    out: dict[int, tuple[RowSpan, ...]] = {}
    start = 0
    for c in cs:
        spans = [(c, 0, own[c])]
        for s, a in units[start : start + counts[c]]:
            if spans[-1][0] == s and spans[-1][2] == a and len(spans) > 1:
                spans[-1] = (s, spans[-1][1], a + unit)  # a run of one stream's units: one span
            else:
                spans.append((s, a, a + unit))
        out[c] = tuple(spans)
        start += counts[c]
    return out


def chunk_sizes(rows: int, sizes: Sequence[int]) -> list[int]:
    """`rows` cut into calls of the given sizes, largest first: as many of the largest as fit, then
    of the next (the smallest must divide what is left)."""
    out = []
    for size in sorted(sizes, reverse=True):
        out += [size] * (rows // size)
        rows %= size
    if rows:
        raise ValueError(f"{rows} rows left over: not a multiple of {min(sizes)}")
    return out


def for_others(work: Sequence[Sequence[int]], who: int) -> str:
    """What replica `who` computes of other streams in a step's recorded work, for people:
    "r1[0:4] r2[4:8]" (stream, rows), or "" when only its own batch."""
    return " ".join(f"r{s}[{a}:{b}]" for c, s, a, b in work if c == who and s != who)


def share_rows(batch: int, live: int, hosts: int) -> int:
    """Rows of its own batch a replica of `live` of its `hosts` hosts computes: in proportion to its
    devices (all of them at full degree; docs/design/replicas.md, "Reduced-degree replicas")."""
    return batch * live // hosts


def row_count(spans: Sequence[RowSpan]) -> int:
    return sum(b - a for _, a, b in spans)


def check_tiling(streams: int, rows: int, work: Sequence[Sequence[int]]) -> str | None:
    """Why a step's recorded work does not train every row of its R batches exactly once (None if
    it does). `work`: [contributor, stream, first row, end row] entries."""
    covered: dict[int, list[tuple[int, int]]] = {s: [] for s in range(streams)}
    for entry in work:
        _, s, a, b = (int(x) for x in entry)
        if s not in covered or not 0 <= a < b <= rows:
            return f"row span {list(entry)} is not rows of a stream's batch (R={streams}, B={rows})"
        covered[s].append((a, b))
    for s, spans in covered.items():
        end = 0
        for a, b in sorted(spans):
            if a != end:
                return f"stream {s}: rows {end}..{a} " + ("trained twice" if a < end else "not trained")
            end = b
        if end != rows:
            return f"stream {s}: rows {end}..{rows} not trained"
    return None
