"""A replica leader stand-in for the multi-process coordinator tests.

Asks for a quorum step after step with the real CoordinatorClient, "trains" (sleeps) and commits,
and prints one JSON line per event on stdout: {"event": "quorum", "t": CLOCK_MONOTONIC, ...}.
Takes commands from a file that the test drops in place (polled every 5 ms; ProcessGroup gives
children no stdin): {"op": "report", "quorum_id": Q, "replica_id": R, "incarnation": I}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from ftjax.base.env import read_token
from ftjax.coordinator.client import CoordinatorClient, CoordinatorError
from ftjax.coordinator.types import MemberInfo, new_incarnation

_print_lock = threading.Lock()


def emit(**event) -> None:
    with _print_lock:
        print(json.dumps(event), flush=True)


def commands(client: CoordinatorClient, path: str) -> None:
    while True:
        if not os.path.exists(path):
            time.sleep(0.005)
            continue
        with open(path, encoding="utf-8") as f:
            cmd = json.load(f)
        os.remove(path)
        if cmd["op"] == "report":
            t_sent = time.monotonic()
            dropped = client.report_failure(cmd["quorum_id"], cmd["replica_id"], cmd["incarnation"], "test report")
            emit(event="report", t_sent=t_sent, t_done=time.monotonic(), dropped=dropped)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--commands", required=True, help="a file the test writes (atomically) to give a command")
    args = p.parse_args()
    token = read_token(args.token_file)
    n = sum(map(ord, args.replica_id))
    member = MemberInfo(
        args.replica_id, new_incarnation(), 1, (f"127.0.0.1:{20000 + n}",), (f"127.0.0.1:{30000 + n}",), "test-topology"
    )
    client = CoordinatorClient(args.address, token, member, heartbeat_interval_s=0.1, quorum_timeout_s=60)
    client.start()
    emit(event="start", replica_id=member.replica_id, incarnation=member.incarnation)
    threading.Thread(target=commands, args=(client, args.commands), daemon=True).start()
    step, position, has_state = 0, 0, True
    while True:
        try:
            q = client.quorum(step, position, has_state)
        except CoordinatorError as e:
            emit(event="error", t=time.monotonic(), error=str(e))
            continue
        emit(
            event="quorum",
            t=time.monotonic(),
            quorum_id=q.quorum_id,
            step=q.step,
            healing=q.healing,
            heal_source=q.heal_source,
            asked_step=step,
            members=[[p.replica_id, p.incarnation] for p in q.participants],
        )
        time.sleep(args.step_s)  # forward, backward, FTAR...
        step, position, has_state = q.step + 1, q.data_position + 1, True  # ...and commit (healed if needed)


if __name__ == "__main__":
    sys.exit(main())
