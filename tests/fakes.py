"""The step protocol's collaborators, faked (tests/unit/test_protocol.py drives the protocol with
them; tests/integration/test_catchup_shards.py builds quorums with them)."""

import threading
from concurrent.futures import Future

import numpy as np

from ftjax.coordinator.quorum import Participant
from ftjax.coordinator.types import QuorumResult
from ftjax.ftar import PeerFailed
from ftjax.runtime.catchup import FetchResult
from ftjax.runtime.protocol import StepProtocol
from ftjax.runtime.replay import ReplayBuffer


def participant(rid, step=0, position=0, healing=False, source=""):
    return Participant(rid, f"{rid}-inc", step, position, (f"{rid}-host:1",), (f"{rid}-host:2",), healing, source)


def quorum(qid, step, members, me, *, healing=False, source="", position=0):
    rank = [p.replica_id for p in members].index(me)
    return QuorumResult(
        quorum_id=qid,
        step=step,
        participants=tuple(members),
        rank=rank,
        healing=healing,
        heal_source=source,
        heal_source_addresses=(f"{source}-host:2",) if source else (),
        num_contributors=sum(not p.healing for p in members),
        data_position=position,
        no_state=False,
    )


class FakeQuorums:
    """Answers each request with the next scripted quorum; remembers what was asked and reported."""

    def __init__(self, answers, decisions=()):
        self.answers, self.asked, self.reports, self.known_positions = list(answers), [], [], {}
        self.decisions, self.votes = list(decisions), []  # ft.commit_decision coordinator: the answers, the votes

    def quorum_async(self, step, data_position, has_state, commit_failures=0, digest=""):
        self.asked.append((step, data_position, has_state, commit_failures))
        future = Future()
        future.set_result(self.answers.pop(0))
        return future

    def report_failure(self, quorum_id, replica_id, incarnation, reason=""):
        self.reports.append((quorum_id, replica_id, incarnation))
        return True

    def vote_commit(self, q, ok, reason, timeout_s):
        self.votes.append((q.quorum_id, ok, reason, timeout_s))
        return self.decisions.pop(0)

    def leave(self, reason):
        self.left = reason

    def close(self):
        pass


class FakeReducer:
    """Sums what it is given with a peer's fixed contribution; fails the calls it is told to."""

    def __init__(self, fail_steps=(), peer=None):
        peer = np.full(4, 2.0, np.float32) if peer is None else peer
        self.fail_steps, self.peer, self.calls = set(fail_steps), peer, []

    def average(self, q, grads):
        self.calls.append((q.quorum_id, None if grads is None else grads.copy()))
        if (q.quorum_id, q.step) in self.fail_steps:
            self.fail_steps.discard((q.quorum_id, q.step))
            raise PeerFailed("connection reset", peer="b-host:1", quorum_id=q.quorum_id, step=q.step)
        mine = np.zeros(4, np.float32) if grads is None else grads
        return (mine + self.peer) / q.num_contributors

    def tree(self, update):
        return update

    def detach(self, update):
        return update

    def close(self):
        pass


class FakeFetch:
    def __init__(self, source, result):
        self.source, self.result, self.error, self.done = source, result, None, threading.Event()
        self.done.set()  # (the transfer is instant here)

    def progress(self):
        return {"bytes_done": 1000, "bytes_total": 1000, "eta_s": 0.0}


class FakeTransport:
    """A source's snapshot of step 5 (all ones), available as soon as it is asked for."""

    def __init__(self):
        self.fetches, self.offers = [], []
        self.address = "me-host:2"
        self.released = 0  # times the protocol said no fetch is coming

    def fetch(self, address, key, *, source, min_step):
        self.fetches.append((address, key, source, min_step))
        return FakeFetch(source, FetchResult(5, {"step": 5}, 1000, 0.5, source, shards=None))

    def load(self, fetched, abstract_state):
        return np.ones(4, np.float32) * fetched.step

    def release(self):
        self.released += 1

    def offered(self, key):
        return key in self.offers

    def offer(self, key, state, step, meta):
        self.offers.append(key)

    def keep_only(self, keys):
        pass

    def close(self):
        pass


class OneHost:
    rank, hosts = 0, 1

    def broadcast_bytes(self, data):
        return data

    def allgather(self, obj):
        return [obj]


class Events:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))

    def kinds(self):
        return [k for k, _ in self.events]


def protocol(tmp_path, quorums, reducer, transport=None):
    return StepProtocol(
        replica_id="a",
        incarnation="a-inc",
        group=OneHost(),
        reducer=reducer,
        transport=transport or FakeTransport(),
        quorums=quorums,
        buffer=ReplayBuffer(tmp_path / "replay", 8),
        log=Events(),
    )
