"""The coordinator's status page (`/`), rendered from `CoordinatorState.snapshot` (what `/status` serves).

A person should understand the job at a glance: how far it is and when it ends, whether every
replica trains and, if not, what happened to the one that does not and what followed. So, from
top to bottom: the job's figures (steps, ETA, tokens/s, loss, ETTR), a banner for anything that
needs explaining (no progress, start-up, a reduced job), each replica's state in words and in the
lifecycle colours of `timeline.png`, the latest failures with what happened next, a live timeline
and the loss curve (inline SVG), and the coordinator's own details folded away at the bottom.

A DiLoCo job (the snapshot's job has `sync`: its step reports carry inner steps) counts outer
rounds where an every-step job counts steps, and shows its inner steps per round and the bytes its
replicas averaged; an every-step job's page is what it was before DiLoCo.

The page is one self-contained document (no external asset: it must work on a cluster without
internet). The server renders all of it, so it reads the same without JavaScript (it then reloads
itself every 5 s); a small script refreshes it in place every 2 s instead, keeps folded sections
as the reader left them, and says so when the coordinator stops answering.
"""

from __future__ import annotations

import html
import math
import time

from ftjax.runs.lifecycle import PHASE_COLORS, Phase

REFRESH_S = 2
HISTORY_ROWS = 10  # quorums shown in the details (the JSON has them all)
TABLE_ROWS = 200  # replicas listed (the ones not training first)
TIMELINE_ROWS = 64
# A replica connects to the coordinator once it has imported JAX and compiled its step: the
# coordinator knows nothing of it before (measured: 30-45 s for configs/tiny.yaml on a busy 2-core machine).
STARTUP_NOTE = (
    "a replica connects once its processes have started JAX and compiled the training step "
    "(tens of seconds; on a small machine 30-45 s for configs/tiny.yaml)"
)

_TEXT_ON = {Phase.STARTING.value: "#08306b", Phase.DONE.value: "#333", Phase.STALLED.value: "#3a1d00"}


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def duration(seconds: float | None) -> str:
    """'850 ms', '12.3 s', '4 min 05 s', '2 h 10 min'."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def clock(wall: float | None) -> str:
    return "-" if wall is None else time.strftime("%H:%M:%S", time.localtime(wall))


def count(n: float | None, unit: str = "") -> str:
    if n is None or not math.isfinite(n):
        return "-"
    for div, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}{unit}"
    return f"{n:.0f}{' ' + unit if unit else ''}"


def percent(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.1%}"


def _loss(v: float | None) -> str:
    return "-" if v is None else ("NaN" if isinstance(v, float) and math.isnan(v) else f"{v:.4f}")


def badge(phase: str, text: str | None = None) -> str:
    color = PHASE_COLORS.get(phase, "#999")
    fg = _TEXT_ON.get(phase, "#fff")
    return f'<span class="badge" style="background:{color};color:{fg}">{esc(text or phase)}</span>'


def unit(s: dict, plural: bool = False) -> str:
    """What the job's steps are: steps, or DiLoCo's outer rounds. With a synchronous warm-up they
    are steps (W synchronous steps, then the rounds: the DiLoCo card says which)."""
    sync = s["job"].get("sync")
    word = "outer round" if sync and not sync.get("warmup_steps") else "step"
    return word + "s" if plural else word


def _diloco_card(sync: dict, done: int, streaming: str) -> tuple[str, str, str]:
    """The rounds' inner steps, or where the synchronous warm-up is (ft.sync_warmup_steps)."""
    warmup, total = sync["warmup_steps"], f"{sync['optimizer_steps']:,} optimizer steps in all"
    if warmup and not sync["outer_rounds"]:
        return "DiLoCo", "synchronous warm-up", f"{done:,} of its {warmup:,} steps: gradients averaged every step"
    first = f", the first {warmup:,} synchronous" if warmup else ""
    return "DiLoCo", f"{sync['inner_steps']} inner steps", f"per outer round ({total}{first}){streaming}"


# --- sections ---------------------------------------------------------------------------------------
def _overall(s: dict) -> tuple[str, str]:
    """(phase colour key, words) for the whole job."""
    job = s["job"]
    if s.get("no_progress"):
        return Phase.DOWN.value, "no progress"
    if job["finished"]:
        return Phase.DONE.value, "finished" if not s["alive"] else "finished: replicas catching up"
    if s["quorum"] is None:
        return Phase.STARTING.value, "starting"
    states = [r["state"] for r in s["replicas"]]
    size = job["replicas"] or len(states)
    if job["training"] == 0:
        return Phase.STALLED.value, "waiting"
    if job["training"] < size:
        return Phase.STALLED.value, "training, reduced"
    if all(st == Phase.STALLED.value for st in states):
        return Phase.STALLED.value, "stalled"
    return Phase.TRAINING.value, "training"


def _figures(s: dict) -> str:
    job = s["job"]
    target, done = job["target_steps"], job["committed_steps"]
    pct = f"{100 * done / target:.0f}%" if target else ""
    bar = f'<div class="bar"><div style="width:{min(100.0, 100 * done / target):.1f}%"></div></div>' if target else ""
    steps = f"{done:,}" + (f" / {target:,}" if target else "")
    rate = f"{job['steps_per_s']:.2f} {unit(s, plural=True)}/s" if job["steps_per_s"] else f"no {unit(s)} yet"
    eta = ("done" if job["finished"] else duration(job["eta_s"])) if job["eta_s"] is not None else "-"
    size = job["replicas"] or len(s["replicas"])
    training = job["training"]
    ettr = f"{job['ettr']:.3f}" if job["ettr"] is not None else "-"
    goodput = count(job["goodput_tokens_per_s"], "tokens/s") if job["goodput_tokens_per_s"] is not None else ""
    median = f"median {unit(s)} {duration(job['median_step_s'])}" if job["median_step_s"] else ""
    cards = [
        (f"committed {unit(s, plural=True)}", steps, f"{pct} {bar}"),
        ("ETA", eta, rate),
        ("throughput", count(job["tokens_per_s"], "tokens/s"), f"{count(job['tokens_total'])} tokens so far"),
        ("loss", _loss(job["loss"]), "mean of the replicas' latest batches"),
        ("ETTR so far", ettr, f"goodput {goodput}" if goodput else "from warm-up (every replica trained) on"),
        ("replicas training", f"{training} of {size}" if size else "0", median),
    ]
    sync = job.get("sync")
    if sync:
        streaming = (
            f"; streaming: fragment {sync['fragment']} averaged last ({sync['fragments_seen']} seen)"
            if sync["fragments_seen"] > 1
            else ""
        )
        per_token = sync["bytes_per_token"]
        cards += [
            _diloco_card(sync, done, streaming),
            (
                "bytes averaged",
                count(sync["bytes_total"], "B"),
                f"{count(sync['bytes_per_round'], 'B')} per replica per round"
                + (f", {_per_token(per_token)} B/token" if per_token is not None else ""),
            ),
        ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div><div class="s">{sub}</div></div>'
            for k, v, sub in cards
        )
        + "</div>"
    )


def _banners(s: dict) -> str:
    out = []
    if s.get("no_progress"):
        out.append(("bad", s["no_progress"]))
    job, expected, connected = s["job"], s.get("expected_replicas") or 0, len(s["replicas"])
    if s["quorum"] is None:
        if connected == 0:
            want = f"{expected} replicas are expected" if expected else "no replica has connected yet"
            out.append(
                (
                    "info",
                    f"Waiting for the replicas: none has connected yet ({want}). {STARTUP_NOTE[0].upper()}"
                    f"{STARTUP_NOTE[1:]}, so the first half-minute or so of a job looks empty here.",
                )
            )
        else:
            want = f" of {expected} expected" if expected else ""
            out.append(
                (
                    "info",
                    f"Starting: {connected}{want} replicas connected, no quorum yet "
                    f"({s['waiting_because']}). {STARTUP_NOTE[0].upper()}{STARTUP_NOTE[1:]}.",
                )
            )
    elif not job["finished"]:
        size = job["replicas"] or 0
        if size and job["training"] < size:
            out.append(
                (
                    "warn",
                    f"Reduced: {job['training']} of {size} replicas train; the others are listed "
                    "below with what happened to them. The job goes on without them (their data "
                    "streams wait) and each one catches up from a peer when it is back.",
                )
            )
    if job["finished"]:
        out.append(
            (
                "good",
                f"Finished: {job['committed_steps']:,} {unit(s, plural=True)} committed at {clock(job['finished_at'])}.",
            )
        )
    if job.get("first_step"):
        out.append(
            (
                "info",
                f"This coordinator started at {clock(s['started_at'])} ({duration(s['uptime_s'])} ago), "
                f"when the job was at step {job['first_step']:,} (it was restarted): its records "
                "(failures, timeline, restarts, ETTR) begin then.",
            )
        )
    return "".join(f'<div class="banner {kind}">{esc(text)}</div>' for kind, text in out)


def _replicas(s: dict) -> str:
    rows = s["replicas"]
    if not rows:
        return '<p class="muted">No replica has connected yet.</p>'
    order = {Phase.DOWN.value: 0, Phase.STALLED.value: 1, Phase.CATCHING_UP.value: 2, Phase.STARTING.value: 3}
    shown = sorted(rows, key=lambda r: order.get(r["state"], 9))[:TABLE_ROWS] if len(rows) > TABLE_ROWS else rows
    sync = bool(s["job"].get("sync"))
    body = []
    for r in shown:
        loss = _loss(r.get("loss"))
        step_time = duration(r.get("step_time_s")) if r.get("step_time_s") else "-"
        heard = "-" if not r["alive"] and r.get("departed_s") is not None else duration(r["heartbeat_age_s"]) + " ago"
        restarts = r.get("restarts", 0)
        words = "" if r["state_text"] == r["state"] else f' <span class="words">{esc(r["state_text"])}</span>'
        body.append(
            f'<tr class="st-{esc(r["state"].replace(" ", "-"))}"><td class="rid">{esc(r["replica_id"])}</td>'
            f"<td>{badge(r['state'])}{words}</td>"
            f'<td class="n">{r["step"]:,}</td><td class="n">{loss}</td><td class="n">{step_time}</td>'
            f'<td class="n">{count(r.get("tokens_per_s"))}</td><td class="n">{percent(r.get("mfu"))}</td>'
            f'<td class="n">{_loss(r.get("eval_loss"))}</td>'
            + (_sync_cells(r) if sync else "")
            + f'<td class="n">{r["data_position"]:,}</td>'
            f'<td class="n">{restarts}</td><td class="n">{esc(heard)}</td></tr>'
        )
    more = f'<p class="muted">{len(rows) - len(shown)} more in /status.</p>' if len(shown) < len(rows) else ""
    head = (
        '<table class="replicas"><tr><th>replica</th><th>state</th><th>step</th><th>loss</th><th>step time</th>'
        "<th>tokens/s</th><th>MFU</th><th>eval loss</th><th>data position<sup>*</sup></th><th>restarts</th><th>last heard</th></tr>"
    )
    if sync:
        head = head.replace("<th>step</th>", "<th>round</th>").replace("<th>step time</th>", "<th>round time</th>")
        head = head.replace("<th>data position", "<th>averaged</th><th>B/token</th><th>data position")
    return (
        head
        + "".join(body)
        + "</table>"
        + more
        + '<p class="note"><sup>*</sup> data position: the next batch of the replica\'s own data stream, i.e. how '
        "many of its batches the job has trained. It equals the step count while the replica trains from the "
        "start; a replica that was down or caught up trails it by the steps the job took without its batches "
        "(they were not skipped: its stream resumes where it stopped). Step, loss, tokens/s and MFU (model FLOPs "
        "over step time x devices x peak FLOP/s; - where the peak is not known) are from the "
        "replica's latest report; restarts count the incarnations this coordinator has seen."
        + (
            " DiLoCo: a round is an outer round (its inner steps, then an average of the parameter deltas); "
            "averaged: the float32 bytes of the deltas the replica averaged since this coordinator started, "
            "B/token: per token it trained in those rounds."
            if sync
            else ""
        )
        + "</p>"
    )


def _sync_cells(r: dict) -> str:
    """A DiLoCo replica's bytes averaged in all, and per token."""
    per_token = r.get("sync_bytes_per_token")
    return (
        f'<td class="n">{count(r.get("sync_bytes_total"), "B") if r.get("sync_bytes_total") else "-"}</td>'
        f'<td class="n">{_per_token(per_token) if per_token is not None else "-"}</td>'
    )


def _per_token(b: float) -> str:
    return f"{b:,.0f}" if b >= 100 else f"{b:.3g}"


def _incident(inc: dict, s: dict) -> str:
    median = s["job"]["median_step_s"]
    at = f"{unit(s)} {inc['step']:,}" if inc["step"] is not None else "before the first quorum"
    head = (
        f'<div class="when">{clock(inc["time"])} <span class="muted">({duration(inc["age_s"])} ago)</span></div>'
        f'<div class="what">{badge(Phase.DOWN.value, "failure")} <b>replica {esc(inc["replica"])}</b> '
        f"(incarnation {inc['incarnation']}) went down at {at}: {esc(inc['how'])}</div>"
    )
    then = []
    if inc["stall_s"] is not None:
        waited = inc["stall_s"]
        if median and waited > 2 * median:
            then.append(f"the job stood still for {duration(waited)} (median step {duration(median)}), then went on")
        else:
            then.append(f"the job did not wait (its next step came {duration(waited)} after the previous one)")
    if inc["quorum_after"]:
        c, n = inc["quorum_after"]
        then.append(f"next quorum: {c} of {n} participants contributing")
    if inc["restarted_after_s"] is not None:
        then.append(f"restarted {duration(inc['restarted_after_s'])} after the failure")
    elif inc["open"] and inc.get("outcome") is None:
        then.append(
            f"not back yet ({duration(inc['age_s'])}): a restarted replica shows here once its processes "
            "have started JAX and compiled, and it connects"
        )
    if inc["healing_from"] is not None:
        if inc["catchup_s"] is not None:
            then.append(f"caught up from replica {esc(inc['healing_from'])} in {duration(inc['catchup_s'])}")
        else:
            then.append(
                f"healing from replica {esc(inc['healing_from'])} ({duration(inc.get('healing_for_s'))} so far)"
            )
    if inc["back_after_s"] is not None:
        then.append(
            f"training again at {unit(s)} {inc['back_step']:,}, {duration(inc['back_after_s'])} after the failure"
        )
    if inc.get("outcome"):
        then.append(esc(inc["outcome"]))
    items = "".join(f"<li>{t}</li>" for t in then)
    return f'<div class="incident{" open" if inc["open"] else ""}">{head}<ul class="then">{items}</ul></div>'


def _failures(s: dict) -> str:
    incidents = s["incidents"]
    if not incidents:
        reports = [f for f in s["failures"] if f["kind"] in ("implausible", "report") and f["outcome"] != "ALIVE"]
        extra = f" ({len(s['failures'])} failure signals are listed in the details below)" if s["failures"] else ""
        return (
            f'<p class="muted">No replica has failed since this coordinator started{extra}.</p>'
            if not reports
            else f'<p class="muted">No replica went down; {len(reports)} failure reports or refusals below.</p>'
        )
    return "".join(_incident(inc, s) for inc in incidents[:10])


def _ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round numbers from lo to hi, about n of them."""
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _timeline(s: dict) -> str:
    tl = s["timeline"]
    rows = list(tl["replicas"].items())[:TIMELINE_ROWS]
    if not rows:
        return '<p class="muted">Nothing yet.</p>'
    # from the first replica's first record (before it the coordinator saw nothing) to now
    lo = min((segs[0][0] for _, segs in rows if segs), default=0.0)
    hi = max(tl["now_s"], lo + 1.0)
    lo = max(0.0, lo - 0.02 * (hi - lo))
    label_w, width, row_h = 90, 1000, 20
    plot_w = width - label_w - 10
    height = 30 + row_h * len(rows) + 24

    def x(t: float) -> float:
        return label_w + plot_w * (max(lo, min(t, hi)) - lo) / (hi - lo)

    base = 10 + row_h * len(rows)
    parts = []
    for t in _ticks(lo, hi):
        parts.append(
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="10" y2="{base + 4}" class="grid"/>'
            f'<text x="{x(t):.1f}" y="{base + 16}" text-anchor="middle" class="tick">{t:g}</text>'
        )
    for i, (rid, segs) in enumerate(rows):
        y: float = 10 + i * row_h
        parts.append(f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end" class="lbl">replica {esc(rid)}</text>')
        for a, b, phase in segs:
            w = max(x(b) - x(a), 0.8)
            parts.append(
                f'<rect x="{x(a):.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" '
                f'fill="{PHASE_COLORS.get(phase, "#999")}"><title>replica {esc(rid)}: {esc(phase)} '
                f"{a:.1f}-{b:.1f} s ({duration(b - a)})</title></rect>"
            )
    index = {rid: i for i, (rid, _) in enumerate(rows)}
    for t, rid in tl["failures"]:
        if rid in index:
            y = 10 + index[rid] * row_h + row_h / 2
            parts.append(
                f'<text x="{x(t):.1f}" y="{y + 5}" text-anchor="middle" class="x">&#x2715;'
                f"<title>replica {esc(rid)} failed at {t:.1f} s</title></text>"
            )
    parts.append(
        f'<text x="{label_w + plot_w}" y="{base + 30}" text-anchor="end" class="tick">seconds since the '
        f"coordinator started ({clock(tl['start'])}); now {clock(s['now'])}</text>"
    )
    legend = " ".join(badge(p.value) for p in Phase if p is not Phase.GONE) + ' <span class="x">&#x2715;</span> failure'
    more = (
        f'<p class="muted">{len(tl["replicas"]) - len(rows)} more replicas in /status.</p>'
        if len(tl["replicas"]) > len(rows)
        else ""
    )
    return (
        f'<svg class="timeline" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="replica states over time">{"".join(parts)}</svg><div class="legend">{legend}</div>{more}'
    )


def _loss_curve(s: dict) -> str:
    pts = [(a, b) for a, b in s["loss_curve"] if b is not None and math.isfinite(b)]
    if len(pts) < 2:
        return '<p class="muted">No loss reported yet (replicas report theirs with each step).</p>'
    width, height, left, bottom = 1000, 180, 60, 24
    s0, s1 = pts[0][0], pts[-1][0]
    lo, hi = min(b for _, b in pts), max(b for _, b in pts)
    hi = hi if hi > lo else lo + 1

    def xy(step: int, loss: float) -> str:
        return (
            f"{left + (width - left - 10) * (step - s0) / max(1, s1 - s0):.1f},"
            f"{10 + (height - bottom - 10) * (hi - loss) / (hi - lo):.1f}"
        )

    line = " ".join(xy(a, b) for a, b in pts)
    labels = (
        f'<text x="{left - 6}" y="16" text-anchor="end" class="tick">{hi:.3f}</text>'
        f'<text x="{left - 6}" y="{height - bottom}" text-anchor="end" class="tick">{lo:.3f}</text>'
        f'<text x="{left}" y="{height - 6}" class="tick">{unit(s)} {s0:,}</text>'
        f'<text x="{width - 10}" y="{height - 6}" text-anchor="end" class="tick">{unit(s)} {s1:,}</text>'
    )
    return (
        f'<svg class="loss" viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="training loss">'
        f'<polyline points="{line}" fill="none" stroke="#3182bd" stroke-width="1.5"/>{labels}</svg>'
    )


def _details(s: dict) -> str:
    q = s["quorum"]
    if q is None:
        quorum = "<p>No quorum yet.</p>"
    else:
        people = ", ".join(
            f"{esc(p['replica_id'])}" + (f" (healing from {esc(p['heal_source'])})" if p["healing"] else "")
            for p in q["participants"]
        )
        quorum = (
            f"<p>Quorum {q['quorum_id']} at step {q['step']:,}: {len(q['participants'])} participants "
            f"({people}), {q['num_contributors']} contributing; formed because: {esc(q['reason'])}"
            f"{'; nobody had state: restoring durable checkpoints' if q['no_state'] else ''}.</p>"
        )
    waiting = f"<p>Waiting for a quorum: {esc(s['waiting_because'])}.</p>" if s.get("pending") else ""
    history = "".join(
        f"<tr><td>{h['quorum_id']}</td><td>{h['step']:,}</td><td>{len(h['participants'])}</td>"
        f"<td>{esc(h['reason'])}</td><td>{h['wait_s'] * 1000:.1f} ms</td>"
        f"<td>{esc(', '.join(f'{k} from {v}' for k, v in h['healing'].items()))}</td></tr>"
        for h in s["history"][:HISTORY_ROWS]
    )
    failures = "".join(
        f"<tr><td>{clock(f['time'])}</td><td>{esc(f['kind'])}</td><td>{esc(f['replica_id'])}</td>"
        f"<td>{esc(f['reporter'])}</td><td>{esc(f['outcome'])}</td><td>{esc(f['reason'][:300])}</td></tr>"
        for f in s["failures"][:20]
    )
    st = s["settings"]
    incarnations = ", ".join(f"{esc(r['replica_id'])}: {esc(r['incarnation'])}" for r in s["replicas"][:50])
    counts = ", ".join(f"{esc(k)} {v}" for k, v in sorted(s["failure_counts"].items())) or "none"
    return f"""
<details id="d-quorum"><summary>Current quorum and coordinator</summary>{quorum}{waiting}
<p>Coordinator up {duration(s["uptime_s"])}; settings: min replicas {st["min_replicas"]}, join timeout
{st["join_timeout_s"]:g} s, heartbeat timeout {st["heartbeat_timeout_s"]:g} s, suspect window {st["suspect_window_s"]:g} s;
expected replicas {s.get("expected_replicas") or "-"}; topology fingerprint {esc(s["topology_fingerprint"] or "-")}.</p>
<p>Incarnations: {incarnations or "-"}.</p><p>Failure signals by source:kind: {counts}.</p></details>
<details id="d-history"><summary>Latest quorums</summary><table><tr><th>id</th><th>step</th><th>participants</th>
<th>formed because</th><th>waited</th><th>healing</th></tr>{history}</table></details>
<details id="d-failures"><summary>Failure signals (reports, verdicts, broken streams, refusals)</summary>
<table><tr><th>time</th><th>source</th><th>replica</th><th>reported by</th><th>outcome</th><th>reason</th></tr>{failures}</table>
</details>"""


_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1b1f24}
main{max-width:1100px;margin:0 auto;padding:16px 20px 40px}
header{display:flex;align-items:center;gap:14px;flex-wrap:wrap}
h1{font-size:22px;margin:6px 0}
h2{font-size:16px;margin:22px 0 8px;color:#333}
.muted,.note{color:#666;font-size:13px}.note{margin-top:6px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;white-space:nowrap}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(160px,1fr));gap:10px;margin:12px 0}
.card{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:10px 12px}
.card .k{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:22px;font-weight:650;margin:2px 0}.card .s{font-size:12px;color:#555}
.bar{height:6px;background:#e3e6ea;border-radius:3px;margin-top:4px}.bar div{height:6px;background:#31a354;border-radius:3px}
.banner{padding:9px 12px;border-radius:6px;margin:8px 0;font-size:14px}
.banner.bad{background:#fde0dd;border:1px solid #de2d26;color:#67000d;font-weight:600}
.banner.warn{background:#fff3d6;border:1px solid #f0b429}.banner.info{background:#e6f0fa;border:1px solid #9ecae1}
.banner.good{background:#e5f5e0;border:1px solid #31a354}
table{border-collapse:collapse;background:#fff;width:100%;font-size:14px}
td,th{border-bottom:1px solid #e3e6ea;padding:5px 8px;text-align:left;vertical-align:top}
th{font-size:12px;color:#555;font-weight:600;background:#fafbfc}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}td.rid{font-weight:700}
tr.st-down{background:#fff0ee}tr.st-down .words{color:#a50f15;font-weight:600}
tr.st-stalled{background:#fff6ec}tr.st-catching-up{background:#f4f2fa}
.incident{background:#fff;border:1px solid #dde1e6;border-left:5px solid #de2d26;border-radius:6px;padding:8px 12px;margin:8px 0}
.incident:not(.open){border-left-color:#31a354}
.incident .when{font-size:12px;color:#555}.incident .what{margin:3px 0}
.then{margin:4px 0 0 0;padding-left:20px;font-size:14px;color:#333}.then li::marker{content:"\\2192  "}
svg text.lbl{font-size:12px;fill:#333}svg text.tick{font-size:11px;fill:#666}svg line.grid{stroke:#e3e6ea}
svg .x,.legend .x{fill:#000;color:#000;font-weight:700;font-size:13px}
svg.timeline,svg.loss{background:#fff;border:1px solid #dde1e6;border-radius:6px}
.legend{margin:6px 0;display:flex;gap:6px;flex-wrap:wrap;align-items:center;font-size:13px}
details{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:6px 10px;margin:8px 0;font-size:14px}
summary{cursor:pointer;font-weight:600}
#offline{display:none}
"""

_SCRIPT = """
(function(){
  var failedSince = null;
  function fmt(d){return d.toTimeString().slice(0,8);}
  function refresh(){
    fetch(location.pathname + location.search, {cache: "no-store"}).then(function(r){
      if(!r.ok) throw new Error("HTTP " + r.status);
      return r.text();
    }).then(function(text){
      var doc = new DOMParser().parseFromString(text, "text/html");
      var fresh = doc.getElementById("page"), page = document.getElementById("page");
      if(!fresh || !page) return;
      var open = {};
      page.querySelectorAll("details[id]").forEach(function(d){open[d.id] = d.open;});
      page.innerHTML = fresh.innerHTML;
      page.querySelectorAll("details[id]").forEach(function(d){if(d.id in open) d.open = open[d.id];});
      document.title = doc.title;
      failedSince = null;
    }).catch(function(){
      if(failedSince === null) failedSince = new Date();
      var b = document.getElementById("offline");
      if(b){b.style.display = "block";
        b.textContent = "The coordinator has not answered since " + fmt(failedSince) +
          " (restarting, or gone): this is what it last said.";}
    });
  }
  setInterval(refresh, REFRESH_MS);
})();
""".replace("REFRESH_MS", str(REFRESH_S * 1000))


def status_page(snapshot: dict) -> str:
    """The whole page for one snapshot (`CoordinatorState.snapshot`)."""
    s = snapshot
    phase, words = _overall(s)
    job = s["job"]
    steps = f"{unit(s)} {job['committed_steps']:,}" + (f"/{job['target_steps']:,}" if job["target_steps"] else "")
    title = f"ftjax: {words}, {steps}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<noscript><meta http-equiv="refresh" content="5"></noscript>
<title>{esc(title)}</title><style>{_STYLE}</style></head><body><main id="page">
<header><h1>ftjax coordinator</h1>{badge(phase, words)}
<span class="muted">updated {clock(s["now"])} &middot; refreshes every {REFRESH_S} s &middot;
<a href="/status">/status</a> (JSON) &middot; <a href="/metrics">/metrics</a></span></header>
<div id="offline" class="banner bad"></div>
{_banners(s)}
{_figures(s)}
<h2>Replicas</h2>
{_replicas(s)}
<h2>Latest failures</h2>
{_failures(s)}
<h2>Timeline</h2>
{_timeline(s)}
<h2>Loss</h2>
{_loss_curve(s)}
<h2>Details</h2>
{_details(s)}
</main><script>{_SCRIPT}</script></body></html>
"""
