"""What an operator keeps open: the coordinator's status page, /metrics, and what the launcher shows.

The page's story (states in words, incidents with what happened next, the job's figures) is
checked on a state driven with a fake clock; /metrics against `promtool check metrics`; and the
page itself in headless Chromium during a real job in which a replica is killed and restarted.
Chromium and promtool are Debian packages (`apt-get install chromium prometheus`): a test that
needs one is skipped without it, unless CI=true, where it fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.request
from html import unescape
from pathlib import Path

import grpc
import pytest
from conftest import REPO

from ftjax.coordinator.client import CoordinatorClient, CoordinatorError
from ftjax.coordinator.page import status_page
from ftjax.coordinator.progress import StepFigures
from ftjax.coordinator.quorum import MemberReport, Settings
from ftjax.coordinator.server import CoordinatorServer
from ftjax.coordinator.state import CoordinatorState
from ftjax.coordinator.types import MemberInfo, new_incarnation
from ftjax.launch import LocalJob
from ftjax.launch.view import CoordinatorProbe, LiveView

TINY = f"{REPO}/configs/tiny.yaml"
TOKEN = "test-token"


def tool(name: str, package: str) -> str:
    """The path of an external tool; skip without it, fail without it when CI=true."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI=true requires it")
        pytest.skip(message)
    return path


def text_of(html: str) -> str:
    """The visible text of a page, tags dropped and spaces collapsed."""
    html = re.sub(r"(?s)<(script|style)\b.*?</\1>", " ", html)
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def row_states(html: str) -> dict[str, str]:
    """Replica id -> the state class of its row in the replicas table."""
    return {rid: st for st, rid in re.findall(r'<tr class="st-([a-z-]+)"><td class="rid">([^<]+)</td>', html)}


# --- the story, on a fake clock -------------------------------------------------------------------
class FakeJob:
    """Three replicas of 300 steps driving a CoordinatorState the way real members do: reports
    with each request, one killed (its stream ends, a peer reports it), restarted, healing, back."""

    def __init__(self) -> None:
        self.state = CoordinatorState(
            Settings(min_replicas=1, heartbeat_timeout_s=2.0, expected_replicas=3), 0.0, startup_grace=0.0
        )
        self.t = 0.0
        self.inc = {r: f"inc{r}a" for r in "012"}
        self.pos = dict.fromkeys("012", 0)
        self.have = dict.fromkeys("012", False)
        self.mine = dict.fromkeys("012", 0)
        self.alive = set("012")
        self.step = 0

    def member(self, r: str) -> MemberReport:
        return MemberReport(
            r,
            self.inc[r],
            step=self.mine[r],
            data_position=self.pos[r],
            has_state=self.have[r],
            ftar_addresses=(f"127.0.0.1:{100 + int(r)}",),
            catchup_addresses=("127.0.0.1:9",),
            topology_fingerprint="fp",
        )

    def quorum(self, dt: float = 0.1):
        self.t += dt
        for r in sorted(self.alive):
            contributed = self.mine[r] == self.step and self.have[r]
            fig = (
                StepFigures(
                    self.mine[r], True, contributed, 5.0 - 0.01 * self.step, 0.1, 4096 if contributed else 0, 300, 3
                )
                if self.mine[r]
                else None
            )
            self.state.request(self.member(r), self.t, fig)
        q = self.state.evaluate(self.t).quorum
        assert q is not None, self.state.explain(self.t)
        if q.no_state:
            for r in self.alive:
                self.have[r] = True
            return q
        for p in q.participants:
            if not p.healing:
                self.mine[p.replica_id] = q.step + 1
                self.pos[p.replica_id] += 1
        self.step = q.step + 1
        return q

    def page(self) -> tuple[dict, str]:
        snap = self.state.snapshot(self.t)
        return snap, status_page(snap)


def test_the_page_tells_a_failure_and_what_happened_next():
    job = FakeJob()
    snap, page = job.page()
    assert "none has connected yet" in text_of(page) and "30-45 s" in text_of(page)  # start-up is explained
    for r in "012":
        job.state.register(job.member(r), job.t)
    snap, page = job.page()
    assert row_states(page) == dict.fromkeys("012", "starting")
    assert "waiting for the job's first quorum" in text_of(page)
    job.quorum(1.0)  # nobody has state: every replica inits
    for _ in range(101):  # quorums at steps 0..100: 100 steps committed
        job.quorum()
    snap, page = job.page()
    assert row_states(page) == dict.fromkeys("012", "training")
    figures = snap["job"]
    assert figures["target_steps"] == 300 and figures["committed_steps"] == 100 and figures["replicas"] == 3
    assert figures["steps_per_s"] == pytest.approx(10.0, rel=0.05)
    assert figures["eta_s"] == pytest.approx(20.0, rel=0.1)
    assert figures["tokens_per_s"] > 0 and figures["ettr"] == pytest.approx(1.0, abs=0.05)
    assert figures["loss"] == pytest.approx(4.0, abs=0.03)
    assert "True" not in text_of(page) and "None" not in text_of(page)  # words, not Python values

    # replica 1 dies: its heartbeat stream ends and replica 0 reports it
    job.state.disconnected("1", job.inc["1"], job.t + 0.01)
    job.alive.discard("1")
    verdict = job.state.accuse("1", job.inc["1"], job.t + 0.05, reporter="0", reason="PeerFailed: connection refused")
    assert verdict.verdict == "DROPPED"
    job.t += 0.6  # the survivors' next quorum comes after the detection
    for _ in range(30):
        job.quorum()
    snap, page = job.page()
    assert row_states(page)["1"] == "down"
    row = next(r for r in snap["replicas"] if r["replica_id"] == "1")
    assert row["state_text"].startswith("down since ") and "replica 0 reported it" in row["state_text"]
    assert "reduced: 2 of 3 replicas" in text_of(page)
    (inc,) = snap["incidents"]
    assert inc["replica"] == "1" and inc["step"] == 100 and inc["open"]
    assert inc["stall_s"] == pytest.approx(0.7, abs=0.05)  # from its last step to the survivors' next
    assert inc["quorum_after"] == [2, 2] and inc["restarted_after_s"] is None
    text = text_of(page)
    assert text.index("Latest failures") < text.index("Timeline") < text.index("Details")  # failures come first
    assert "went down at step 100" in text and "the job stood still for 700 ms" in text and "not back yet" in text

    # it restarts (a new incarnation), heals from a peer for 2 s, then trains again
    job.inc["1"], job.have["1"], job.mine["1"], job.pos["1"] = "inc1b", False, 0, 30
    job.state.register(job.member("1"), job.t)
    job.alive.add("1")
    q = job.quorum()
    assert [p.healing for p in q.participants] == [False, True, False]
    snap, page = job.page()
    row = next(r for r in snap["replicas"] if r["replica_id"] == "1")
    assert row["state"] == "catching up" and row["state_text"].startswith("healing from replica 0")
    assert row["restarts"] == 1 and row["incarnation_number"] == 2
    for _ in range(19):
        job.quorum()
    job.have["1"], job.mine["1"] = True, job.step
    for _ in range(10):
        job.quorum()
    snap, page = job.page()
    assert row_states(page) == dict.fromkeys("012", "training")
    (inc,) = snap["incidents"]
    assert not inc["open"] and inc["restarted_after_s"] == pytest.approx(3.55, abs=0.02)
    assert inc["healing_from"] == "0" and inc["catchup_s"] == pytest.approx(2.0, abs=0.05)
    assert inc["back_step"] == 151 and inc["back_after_s"] == pytest.approx(5.65, abs=0.02)
    text = text_of(page)
    assert "caught up from replica 0 in 2.0 s" in text and "training again at step 151" in text
    phases = [seg[2] for seg in snap["timeline"]["replicas"]["1"]]
    assert phases == ["starting", "training", "down", "starting", "catching up", "training"], phases
    assert [f[1] for f in snap["timeline"]["failures"]] == ["1"]
    assert '<svg class="timeline"' in page and '<svg class="loss"' in page
    assert 0.7 < snap["job"]["ettr"] < 1.0  # replica 1 was out for ~5.6 s of ~16 s

    # the job reaches its target, the replicas finish and leave: done, not down
    while job.step < 300:
        job.quorum()
    job.quorum()  # at the target step: they drain (serve peers) until every replica holds the final state
    for r in "012":
        job.state.disconnected(r, job.inc[r], job.t + 0.01)
    job.t += 1.0
    job.state.evaluate(job.t)
    snap, page = job.page()
    assert row_states(page) == dict.fromkeys("012", "done") and len(snap["incidents"]) == 1
    assert snap["job"]["finished"] and "Finished: 300 steps committed" in text_of(page)


def test_a_replica_that_leaves_the_job_says_why():
    job = FakeJob()
    for r in "012":
        job.state.register(job.member(r), job.t)
    for _ in range(20):
        job.quorum(1.0 if job.t == 0 else 0.1)
    # the progress watchdog: it cancels its stream and accuses itself
    job.state.disconnected("2", job.inc["2"], job.t + 0.01)
    job.state.accuse("2", job.inc["2"], job.t + 0.02, reporter="2", reason="replica 2 host 0: no progress for 30.0 s")
    snap, _ = job.page()
    assert snap["incidents"][0]["how"] == "it left the job: replica 2 host 0: no progress for 30.0 s"


# --- the wire: reports travel with quorum requests ------------------------------------------------
def _info(rid: str) -> MemberInfo:
    n = 100 + ord(rid[0]) % 50
    return MemberInfo(rid, new_incarnation(), 1, (f"127.0.0.1:{20000 + n}",), (f"127.0.0.1:{30000 + n}",), "fp")


@pytest.fixture
def server():
    s = CoordinatorServer(Settings(min_replicas=2, join_timeout_s=5.0), TOKEN, startup_grace=0.0).start()
    yield s
    s.stop()


def _client(server, rid):
    c = CoordinatorClient(server.address, TOKEN, _info(rid), heartbeat_interval_s=0.05, quorum_timeout_s=10.0)
    c.start()
    return c


def _steps(clients, steps, first=1):
    for step in range(first, first + steps):
        for c in clients:
            c.report_step(
                {
                    "step": step,
                    "committed": True,
                    "healing": False,
                    "loss": 3.0 - step / 100,
                    "tokens": 1024,
                    "step_time_s": 0.05,
                },
                target_steps=40,
                replicas=2,
            )
        futures = [c.quorum_async(step, step, True) for c in clients]
        for f in futures:
            f.result(10)


def test_a_bad_step_report_is_refused_naming_the_field(server):
    a = _client(server, "a")
    try:
        a.report_step({"step": 1, "committed": True, "loss": 1.0, "tokens": -5, "step_time_s": 0.1})
        with pytest.raises(CoordinatorError) as e:
            a.quorum(1, 1, True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "report.tokens" in str(e.value)
        assert "a" not in server.state.progress.replicas or server.state.progress.replicas["a"].report is None
    finally:
        a.close()


def _get(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
        return r.read().decode()


def test_the_read_only_pages_need_no_token_and_never_show_it(server):
    """By design (README, "Security"): /, /status and /metrics answer without the token, and
    nothing on them is the token."""
    a, b = _client(server, "a"), _client(server, "b")
    try:
        _steps([a, b], 3)
        pages = {path: _get(server.http_address, path) for path in ("/", "/status", "/metrics")}
    finally:
        a.close()
        b.close()
    assert json.loads(pages["/status"])["replicas"] and "ftjax_job_committed_steps 3.0" in pages["/metrics"]
    for path, text in pages.items():
        assert TOKEN not in text, path


def test_metrics_pass_promtool_and_have_per_replica_series(server, tmp_path):
    promtool = tool("promtool", "prometheus")
    a, b = _client(server, "a"), _client(server, "b")
    try:
        _steps([a, b], 12)
        b.close()  # b goes away mid-job: a failure with a source and a kind
        deadline = time.monotonic() + 10
        while server.state.summary(time.monotonic())["alive"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = _get(server.http_address, "/metrics")
    finally:
        a.close()
        b.close()
    (tmp_path / "metrics.txt").write_text(text)
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for line in (
        'ftjax_replica_up{replica="a"} 1.0',
        'ftjax_replica_up{replica="b"} 0.0',
        'ftjax_replica_state{replica="b",state="down"} 1.0',
        'ftjax_replica_step{replica="a"} 12.0',
        'ftjax_replica_step_seconds{replica="a"} 0.05',
        'ftjax_replica_tokens_per_second{replica="a"} 20480.0',
        "ftjax_job_target_steps 40.0",
        "ftjax_job_committed_steps 12.0",
        "ftjax_job_replicas 2.0",
        'ftjax_coordinator_failures_total{kind="stream_ended",source="disconnect"} 1.0',
    ):
        assert line in text, f"{line!r} not in\n{text}"
    # one departure of b, labelled by what saw it and why (its stream ended, then it stayed silent)
    assert re.search(
        r'^ftjax_coordinator_failures_total\{kind="(suspect_silent|heartbeat_timeout)",'
        r'source="departed"\} 1.0$',
        text,
        re.M,
    ), text
    # a has trained alone since (or stalled: its quorums stopped with the test's steps), b is down
    assert re.search(r'^ftjax_replica_state\{replica="a",state="(training|stalled)"\} 1.0$', text, re.M)
    assert len(re.findall(r'^ftjax_replica_state\{replica="a",state="[a-z ]+"\} 1.0$', text, re.M)) == 1
    for name in (
        "ftjax_replica_loss",
        "ftjax_job_loss",
        "ftjax_job_tokens_total",
        "ftjax_job_eta_seconds",
        "ftjax_job_tokens_per_second",
        "ftjax_job_ettr",
        "ftjax_job_goodput_tokens_per_second",
    ):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.M), f"no sample of {name}"
    loss = float(re.search(r'^ftjax_replica_loss\{replica="a"\} (\S+)$', text, re.M).group(1))
    assert loss == pytest.approx(3.0 - 12 / 100) or loss == pytest.approx(3.0 - 11 / 100)


def test_the_launchers_header_follows_the_coordinator(server):
    from io import StringIO

    from rich.console import Console

    probe = CoordinatorProbe(every_s=0.05, timeout_s=1.0)
    view = LiveView(Console(file=StringIO(), width=200), probe=probe)

    def header(coordinator="up", address=server.http_address):
        view.poll([], {"step": 0, "steps": 40, "coordinator": coordinator, "coordinator_http": address})
        return str(view.live.renderable.renderables[0].title)

    assert "coordinator starting" in header()
    probe.start()
    try:
        deadline = time.monotonic() + 10
        while probe.status is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "waiting for replicas: 0 connected" in header()
        a, b = _client(server, "a"), _client(server, "b")
        try:
            _steps([a, b], 5)
            deadline = time.monotonic() + 10
            while not re.search(r"quorum #\d+: 2 of 2 contributing", header()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert re.search(r"quorum #\d+: 2 of 2 contributing", header()), header()
        finally:
            a.close()
            b.close()
        assert header(coordinator="down").endswith("coordinator DOWN (restarting)")
        probe.address = "127.0.0.1:1"  # nothing listens there
        deadline = time.monotonic() + 10
        while "not answering" not in header(address="127.0.0.1:1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "coordinator not answering for" in header(address="127.0.0.1:1")
    finally:
        probe.stop()


# --- the page in a browser, during a real job with a kill ---------------------------------------------
class Browser:
    """Headless Chromium: each look is one process (a screenshot and the DOM after load), killed on time."""

    def __init__(self, chromium: str, profile: Path, shots: Path) -> None:
        self.chromium, self.profile, self.shots = chromium, profile, shots
        shots.mkdir(parents=True, exist_ok=True)

    def look(self, url: str, name: str, procs) -> str:
        shot = self.shots / f"{name}.png"
        args = [
            self.chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            f"--user-data-dir={self.profile}",
            "--hide-scrollbars",
            "--window-size=1200,1500",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
        ]
        child = procs.start(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            dom, _ = child.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            procs.kill(child)
            child.communicate()
            raise AssertionError(f"chromium did not load {url} within 90 s") from None
        assert child.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (child.returncode, dom[-500:])
        return dom


LIVE = ("training", "stalled")  # a contributing replica's states


def _status(job) -> dict:
    return json.loads(_get(job.coordinator_http, "/status"))


def _wait(job, what: str, ok, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = _status(job)
            if ok(s):
                return s
        except OSError:
            s = None
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s: {json.dumps(s)[-3000:]}\n{job.log_tail(1)}")
        time.sleep(0.2)


def _replica(s: dict, rid: str) -> dict:
    return next((r for r in s["replicas"] if r["replica_id"] == rid), {})


@pytest.mark.slow
def test_the_status_page_in_chromium_during_a_job_with_a_kill(tmp_path, procs):
    """Healthy, down, healed: at each moment Chromium loads the page, and its DOM (after the page's
    script ran) tells the replicas' states and the failure. Screenshots go to tmp_path/shots, or to
    $FTJAX_SCREENSHOTS (how docs/status_page.png is made)."""
    chromium = tool("chromium", "chromium")
    shots = Path(os.environ.get("FTJAX_SCREENSHOTS") or tmp_path / "shots")
    browser = Browser(chromium, tmp_path / "profile", shots)
    # the job never ends by itself (the test stops it); min_replicas 1: the survivor trains alone
    job = LocalJob(
        TINY,
        ["steps=100000", "coordinator.min_replicas=1", "coordinator.heartbeat_timeout_s=2"],
        tmp_path / "run",
        replicas=2,
        procs=procs,
    )
    job.start_coordinator()
    url = f"http://{job.coordinator_http}/"
    dom = browser.look(url, "0-starting", procs)
    assert "Waiting for the replicas" in text_of(dom) or "Starting:" in text_of(dom), text_of(dom)[:2000]
    job.start_replica(0)
    job.start_replica(1)

    def training(s, rid, incarnation=1):
        r = _replica(s, rid)
        return r.get("state") == "training" and r.get("incarnation_number") == incarnation and r.get("loss") is not None

    _wait(job, "both training", lambda s: training(s, "0") and training(s, "1"), 300)
    dom = browser.look(url, "1-healthy", procs)
    # (a live replica may be shown stalled for a moment: this machine is busy, Chromium starting included)
    assert set(row_states(dom).items()) <= {(r, st) for r in "01" for st in LIVE}, text_of(dom)[:3000]
    assert len(row_states(dom)) == 2
    text = text_of(dom)
    assert "2 of 2" in text and "went down" not in text and "Timeline" in text and "tokens/s" in text

    job.kill_replica(1)
    _wait(job, "replica 1 down", lambda s: _replica(s, "1").get("state") == "down" and s["incidents"], 60)
    dom = browser.look(url, "2-down", procs)
    states, text = row_states(dom), text_of(dom)
    assert states["1"] == "down" and states["0"] in LIVE, text[:3000]
    assert "down since" in text and "replica 1 (incarnation 1) went down at step" in text, text[:3000]
    assert "reduced: 1 of 2 replicas" in text

    job.start_replica(1)
    healed = _wait(
        job,
        "replica 1 back",
        lambda s: training(s, "1", incarnation=2) and s["incidents"] and s["incidents"][0]["back_after_s"] is not None,
        300,
    )
    dom = browser.look(url, "3-healed", procs)
    states, text = row_states(dom), text_of(dom)
    assert states["0"] in LIVE and states["1"] in LIVE, text[:3000]
    assert "restarted" in text and "caught up from replica 0 in" in text and "training again at step" in text, text[
        :3000
    ]
    inc = healed["incidents"][0]
    assert inc["healing_from"] == "0" and inc["catchup_s"] is not None and inc["restarted_after_s"] > 0
    phases = [seg[2] for seg in healed["timeline"]["replicas"]["1"]]
    assert "down" in phases and phases[-1] == "training", phases
    promtool = shutil.which("promtool")
    if promtool:  # the live job's /metrics too
        text = _get(job.coordinator_http, "/metrics")
        checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert 'ftjax_replica_restarts_total{replica="1"} 1.0' in text
        assert math.isfinite(float(re.search(r'^ftjax_replica_loss\{replica="1"\} (\S+)$', text, re.M).group(1)))
