"""`ftjax bench coordinator --replicas N`: quorum latency of N simulated replicas.

A real coordinator process serves N simulated replica leaders, spread over a few worker processes
(asyncio, one gRPC connection per worker): each replica heartbeats on its own stream and, step
after step, asks for a quorum, waits for it, then "computes" for --step-ms (with +-10% jitter)
before asking for the next one, as a training replica does.

Quorum latency, per replica and step: from the moment the *last* replica of the job sent its
request for that step to the moment this replica received its answer (CLOCK_MONOTONIC is shared
by all processes of the machine). So it counts the coordinator's work once everybody has asked
(receiving the last request, forming the quorum, answering all N), plus the transport, and none of
the waiting for stragglers. Steps before every replica has joined are not counted.

It also counts the cost of simulating N clients on the same machine (each worker reads its
replicas' answers one after another). The coordinator's own share comes from its latency
histogram (/metrics): server_p50_ms_at_most and server_p99_ms_at_most, per answer, from receiving
the request that completed the quorum to handing the answer to gRPC (bucket upper bounds).

The same run then repeats the steps against a *floor*: a bare grpcio server with the same service,
the same streams and answers of the same size, that forms no quorum (it answers a step's requests
the moment the last one arrives: no validation, no membership, no state). `floor_p99_ms` is what
grpcio itself costs on this machine with these clients; `p99_vs_floor` is the coordinator's p99
over it. (--no-floor skips it.)

--commit-decision: after each answer every replica also votes yes on its step (on its `Commits`
stream, as with ft.commit_decision: coordinator; a ring has just synchronized real replicas, so
the votes arrive together) and waits for the decision: commit_p50_ms and commit_p99_ms, from the
last replica's vote sent to each replica's decision received, and commit_p99_vs_quorum_p99 in the
same run.

Prints one JSON line: p50_ms, p99_ms, max_ms of the end-to-end latency, the server bounds,
heartbeats_per_s handled by the coordinator while the steps ran, the 1-minute load average (the
machine is shared: read the figures with it), and the settings. With --step-ms 0 every replica
asks again the moment it is answered: the coordinator is then saturated and the figure is a
throughput bound rather than a latency.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import NamedTuple

import grpc

from ftjax.base.env import read_token
from ftjax.coordinator import TOKEN_METADATA_KEY
from ftjax.coordinator import coordinator_pb2 as pb
from ftjax.coordinator import coordinator_pb2_grpc as pb_grpc

_WARMUP_STEPS = 2  # the first quorum (everybody joining) and the one after it
# grpc's epoll-based sockets instead of its EventEngine endpoints. Measured here: 58 instead of
# 77-96 us of coordinator CPU per heartbeat message, and p99 140-151 instead of 202-203 ms at 1000
# replicas in alternating runs. The same variable tunes a production coordinator (set it in its env).
FAST_GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_client"
_FIRST_STEP = 100_000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax bench coordinator", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=100, help="simulated replicas asking for each quorum")
    p.add_argument("--steps", type=int, default=22, help="quorums per replica, of which the first 2 are warm-up")
    p.add_argument("--step-ms", type=float, default=250.0, help="simulated compute between two quorums")
    p.add_argument(
        "--heartbeat-interval-ms",
        type=float,
        default=1000.0,
        help="per replica (1 s: a thousand heartbeats a second for a thousand replicas)",
    )
    p.add_argument("--heartbeat-timeout-ms", type=int, default=10_000, help="the coordinator's heartbeat timeout")
    p.add_argument("--procs", type=int, default=2, help="worker processes simulating the replicas")
    p.add_argument("--timeout-s", type=float, default=120.0, help="limit for the whole run")
    p.add_argument(
        "--grpc-experiments",
        default=FAST_GRPC_EXPERIMENTS,
        help="GRPC_EXPERIMENTS for the coordinator and the workers ('' for grpc's defaults)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the run against a bare grpcio server")
    p.add_argument(
        "--commit-decision",
        action="store_true",
        help="after each quorum every replica also votes on its step (ft.commit_decision: coordinator) and "
        "waits for the decision: commit_p50_ms, commit_p99_ms",
    )
    return p


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ftjax_bench.coordinator")
    p.add_argument("--address", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, required=True)
    p.add_argument("--heartbeat-interval-ms", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--commit-decision", action="store_true")
    return p


async def _simulate(args: argparse.Namespace, token: str) -> list[tuple]:
    """Run `count` replicas on one connection; return (step, t_send, t_recv, quorum_id, size) rows,
    with --commit-decision followed by (t_vote_sent, t_decision_received, decision)."""
    metadata = ((TOKEN_METADATA_KEY, token),)
    rows: list[tuple] = []
    async with grpc.aio.insecure_channel(args.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.CoordinatorStub(ch)

        async def heartbeats(call, member, stop: asyncio.Event) -> None:
            await call.write(pb.HeartbeatRequest(member=member))
            # A random phase spreads the heartbeats of all replicas evenly over the interval.
            interval = args.heartbeat_interval_ms / 1000
            await asyncio.sleep(random.uniform(0, interval))
            while not stop.is_set():
                await call.write(pb.HeartbeatRequest())
                await asyncio.sleep(interval)
            await call.done_writing()

        async def replica(i: int) -> None:
            rid = f"bench-{i:05d}"
            member = pb.Member(
                replica_id=rid,
                incarnation=f"{os.getpid()}-{i}",
                num_hosts=1,
                ftar_addresses=[f"127.0.0.1:{20000 + i}"],
                catchup_addresses=[f"127.0.0.1:{40000 + i}"],
                topology_fingerprint="bench-topology",
                has_state=True,
            )
            hb_call = stub.Heartbeat(metadata=metadata)
            stop = asyncio.Event()
            hb = asyncio.create_task(heartbeats(hb_call, member, stop))
            call = stub.Quorum(metadata=metadata)
            votes = stub.Commits(metadata=metadata) if args.commit_decision else None
            known = 0
            for step in range(args.steps):
                # Mid-run numbers (100k steps in), so that the answers have their real size.
                member.step = _FIRST_STEP + step
                member.data_position = _FIRST_STEP + step
                t_send = time.monotonic()
                await call.write(pb.QuorumRequest(member=member, timeout_ms=60_000, known_quorum_id=known))
                answer = await call.read()
                t_recv = time.monotonic()
                known = answer.quorum_id
                row = (answer.step - _FIRST_STEP, t_send, t_recv, answer.quorum_id, answer.num_participants)
                if args.commit_decision:  # the vote of a replica whose every host averaged the step
                    vote = pb.CommitVote(
                        formation=answer.formation,
                        quorum_id=answer.quorum_id,
                        step=answer.step,
                        replica_id=rid,
                        incarnation=member.incarnation,
                        ok=True,
                        timeout_ms=60_000,
                    )
                    t_vote = time.monotonic()
                    await votes.write(vote)
                    decision = await votes.read()
                    row += (t_vote, time.monotonic(), decision.decision)
                rows.append(row)
                if step + 1 < args.steps:
                    await asyncio.sleep(args.step_ms / 1000 * random.uniform(0.9, 1.1))
            await call.done_writing()
            if votes is not None:
                await votes.done_writing()
            stop.set()
            await hb
            await hb_call

        await asyncio.gather(*(replica(i) for i in range(args.first, args.first + args.count)))
    return rows


def _worker(argv: list[str]) -> int:
    args = _worker_parser().parse_args(argv)
    # A simulator of clients, short-lived: its collector pauses would only blur the measurement.
    gc.disable()
    token = read_token(args.token_file)
    try:
        import uvloop  # the same event loop as the server's, when installed

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    rows = run(_simulate(args, token))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    return 0


# --- the floor: a bare grpcio server ------------------------------------------------------------
def _floor_server(argv: list[str]) -> int:
    """Serve the Coordinator service with no logic: heartbeats are counted, and each step's quorum
    requests are all answered the moment the last of `--replicas` arrives, with answers of the
    coordinator's shape and size (the common part serialized once, plus each caller's own fields).
    The same event loop, collector settings and server options as the coordinator's."""
    from ftjax.cli.coordinator import write_ready_file
    from ftjax.coordinator.collector import quiet_garbage_collector
    from ftjax.coordinator.server import SERVER_OPTIONS, new_event_loop
    from ftjax.coordinator.service import SERVICE

    p = argparse.ArgumentParser(prog="python -m ftjax_bench.coordinator floor")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--ready-file", required=True)
    args = p.parse_args(argv)
    n = args.replicas
    waiting: list[tuple[asyncio.Future, pb.QuorumRequest]] = []

    def arrived(future: asyncio.Future, request: pb.QuorumRequest) -> None:
        waiting.append((future, request))
        if len(waiting) < n:
            return
        common = pb.QuorumResponse(
            quorum_id=1,
            step=max(r.member.step for _, r in waiting),
            num_contributors=n,
            num_participants=n,
            data_positions=[r.member.data_position for _, r in waiting],
        )
        members = pb.QuorumResponse(
            members=[
                pb.MemberAddress(
                    replica_id=r.member.replica_id,
                    incarnation=r.member.incarnation,
                    ftar_addresses=r.member.ftar_addresses,
                    catchup_addresses=r.member.catchup_addresses,
                )
                for _, r in waiting
            ]
        )
        known = common.SerializeToString()
        shared = (known, known + members.SerializeToString())
        for rank, (f, _r) in enumerate(waiting):
            f.set_result((shared, rank))
        waiting.clear()

    async def heartbeat(request_iterator, context) -> pb.HeartbeatSummary:
        count = 0
        async for _ in request_iterator:
            count += 1
        return pb.HeartbeatSummary(heartbeats=count)

    async def quorum(request_iterator, context):
        loop = asyncio.get_running_loop()
        async for request in request_iterator:
            future = loop.create_future()
            arrived(future, request)
            (known, unknown), rank = await future
            own = pb.QuorumResponse(rank=rank, data_position=request.member.data_position).SerializeToString()
            yield (known if request.known_quorum_id == 1 else unknown) + own

    async def serve() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Heartbeat": grpc.stream_unary_rpc_method_handler(
                            heartbeat,
                            request_deserializer=pb.HeartbeatRequest.FromString,
                            response_serializer=pb.HeartbeatSummary.SerializeToString,
                        ),
                        "Quorum": grpc.stream_stream_rpc_method_handler(
                            quorum, request_deserializer=pb.QuorumRequest.FromString, response_serializer=None
                        ),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        write_ready_file(args.ready_file, {"grpc": f"127.0.0.1:{port}"})
        await server.wait_for_termination()

    quiet_garbage_collector()
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(serve())
    return 0


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def _wait_ready(path: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {proc.returncode}")
        time.sleep(0.02)
    raise TimeoutError("the coordinator did not start")


class _Scrape(NamedTuple):
    """One read of the coordinator's /metrics (cheap to serve, unlike /status)."""

    t: float
    heartbeats: int
    answers: int  # answers handed to gRPC so far
    answer_buckets: dict[float, float]  # cumulative counts of the per-answer latency histogram


def _scrape(http: str) -> _Scrape:
    heartbeats, answers, buckets = None, None, {}
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("ftjax_coordinator_heartbeats_total "):
                heartbeats = int(float(line.split()[1]))
            elif line.startswith("ftjax_coordinator_quorum_latency_seconds_count "):
                answers = int(float(line.split()[1]))
            elif line.startswith("ftjax_coordinator_quorum_latency_seconds_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                buckets[float(le)] = float(line.rsplit(" ", 1)[1])
    if heartbeats is None or answers is None or not buckets:
        raise RuntimeError("the coordinator's /metrics lacks the heartbeat counter or the latency histogram")
    return _Scrape(time.monotonic(), heartbeats, answers, buckets)


def _bucket_percentile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound (s) of the histogram bucket holding the q-th percentile of what was observed between two scrapes."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1]
    return next(le for le, cumulative in delta if cumulative >= q / 100 * total)


def _run(
    args: argparse.Namespace, procs: int, *, floor: bool = False
) -> tuple[list[tuple], _Scrape | None, _Scrape | None]:
    """Start the server (the coordinator, or with `floor` the bare grpcio server) and the workers;
    return the workers' rows, and the coordinator's metrics once the warm-up quorums were all
    answered and at the end (None for the floor, which keeps none)."""
    from ftjax.base.procs import ProcessGroup

    with tempfile.TemporaryDirectory(prefix="ftjax-bench-coord-") as tmp, ProcessGroup() as group:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w", encoding="utf-8") as f:
            f.write(os.urandom(16).hex())
        ready = os.path.join(tmp, "ready.json")
        env = {"GRPC_EXPERIMENTS": args.grpc_experiments}
        if floor:
            server = group.python(
                "-m",
                "ftjax_bench.coordinator",
                "floor",
                "--replicas",
                str(args.replicas),
                "--ready-file",
                ready,
                env=env,
            )
        else:
            server = group.python(
                "-m",
                "ftjax",
                "coordinator",
                "--port",
                "0",
                "--http-port",
                "0",
                "--min-replicas",
                str(args.replicas),
                "--join-timeout-s",
                "60",
                "--heartbeat-timeout-s",
                str(args.heartbeat_timeout_ms / 1000),
                "--startup-grace-s",
                "0",  # safe here: min_replicas is the whole job
                "--token-file",
                token_file,
                "--ready-file",
                ready,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        addresses = _wait_ready(ready, server, 30)
        workers, outs = [], []
        share, extra = divmod(args.replicas, procs)
        first = 0
        for w in range(procs):
            count = share + (w < extra)
            outs.append(os.path.join(tmp, f"worker{w}.json"))
            workers.append(
                group.python(
                    "-m",
                    "ftjax_bench.coordinator",
                    "--address",
                    addresses["grpc"],
                    "--token-file",
                    token_file,
                    "--first",
                    str(first),
                    "--count",
                    str(count),
                    "--steps",
                    str(args.steps),
                    "--step-ms",
                    str(args.step_ms),
                    "--heartbeat-interval-ms",
                    str(args.heartbeat_interval_ms),
                    "--out",
                    outs[-1],
                    *(["--commit-decision"] if args.commit_decision and not floor else []),
                    env=env,
                )
            )
            first += count
        deadline = time.monotonic() + args.timeout_s

        def wait(done) -> None:
            while not done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {args.timeout_s} s")
                if any(w.poll() not in (None, 0) for w in workers):
                    raise RuntimeError("a worker failed")
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with {server.returncode}")
                time.sleep(0.02)

        # The baseline: every warm-up answer handed out. The next quorum cannot have formed yet
        # (its last request comes a step's compute after the last warm-up answer), and nothing
        # scrapes the coordinator while the measured steps run.
        baseline: list[_Scrape | None] = [None]

        def warmed_up() -> bool:
            baseline[0] = _scrape(addresses["http"])
            return baseline[0].answers >= _WARMUP_STEPS * args.replicas

        if not floor:
            wait(warmed_up)
        wait(lambda: all(w.poll() is not None for w in workers))
        final = None if floor else _scrape(addresses["http"])
        rows = []
        for out in outs:
            with open(out, encoding="utf-8") as f:
                rows += json.load(f)
        return rows, baseline[0], final


def _latencies(rows: list[tuple], replicas: int, steps: int) -> tuple[list[float], set[int], float]:
    """Sorted end-to-end latencies (ms) of the measured steps, their quorum ids, and when the last
    answer arrived. ValueError if a step was not one quorum of every replica."""
    by_step: dict[int, list[tuple]] = {}
    for row in rows:
        by_step.setdefault(row[0], []).append(row)
    latencies: list[float] = []
    ids = set()
    for step, answers in sorted(by_step.items()):
        if len(answers) != replicas or any(a[4] != replicas for a in answers) or len({a[3] for a in answers}) != 1:
            raise ValueError(f"step {step} was not one quorum of all {replicas} replicas")
        if step < _WARMUP_STEPS:
            continue
        ids.add(answers[0][3])
        last_send = max(a[1] for a in answers)
        latencies += [(a[2] - last_send) * 1000 for a in answers]
    latencies.sort()
    return latencies, ids, max(a[2] for a in by_step[steps - 1])


def _decision_latencies(rows: list[tuple]) -> list[float]:
    """Sorted latencies (ms) of the commit decisions of the measured steps: from the last replica's
    vote sent to each replica's decision received. ValueError unless every decision was COMMIT."""
    by_step: dict[int, list[tuple]] = {}
    for row in rows:
        by_step.setdefault(row[0], []).append(row)
    latencies: list[float] = []
    for step, answers in sorted(by_step.items()):
        wrong = {a[7] for a in answers} - {"COMMIT"}
        if wrong:
            raise ValueError(f"step {step}: decisions {sorted(wrong)} where every replica voted yes")
        if step >= _WARMUP_STEPS:
            last_vote = max(a[5] for a in answers)
            latencies += [(a[6] - last_vote) * 1000 for a in answers]
    return sorted(latencies)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.replicas < 1 or args.steps <= _WARMUP_STEPS or args.procs < 1:
        print(f"need --replicas >= 1, --steps > {_WARMUP_STEPS}, --procs >= 1", file=sys.stderr)
        return 2
    procs = min(args.procs, args.replicas)
    try:
        rows, base, final = _run(args, procs)
        latencies, ids, t_end = _latencies(rows, args.replicas, args.steps)
        decisions = _decision_latencies(rows) if args.commit_decision else None
        floor = None if args.no_floor else _latencies(_run(args, procs, floor=True)[0], args.replicas, args.steps)[0]
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"ftjax bench coordinator: {e}", file=sys.stderr)
        return 1
    assert base is not None and final is not None
    p99 = _percentile(latencies, 99)
    result = {
        "bench": "coordinator",
        "replicas": args.replicas,
        "steps": args.steps - _WARMUP_STEPS,
        "p50_ms": round(_percentile(latencies, 50), 2),
        "p99_ms": round(p99, 2),
        "max_ms": round(latencies[-1], 2),
        "server_p50_ms_at_most": _bucket_percentile(base.answer_buckets, final.answer_buckets, 50) * 1000,
        "server_p99_ms_at_most": _bucket_percentile(base.answer_buckets, final.answer_buckets, 99) * 1000,
        # heartbeats stop as each replica gets its last answer
        "heartbeats_per_s": round((final.heartbeats - base.heartbeats) / (t_end - base.t), 1),
        "quorum_ids": len(ids),
    }
    if decisions is not None:  # the decision against the quorum, both per replica and step, same run
        result.update(
            commit_p50_ms=round(_percentile(decisions, 50), 2),
            commit_p99_ms=round(_percentile(decisions, 99), 2),
            commit_p99_vs_quorum_p99=round(_percentile(decisions, 99) / p99, 3),
        )
    if floor is not None:
        result.update(
            floor_p50_ms=round(_percentile(floor, 50), 2),
            floor_p99_ms=round(_percentile(floor, 99), 2),
            p99_vs_floor=round(p99 / _percentile(floor, 99), 3),
        )
    result.update(
        {
            "step_ms": args.step_ms,
            "heartbeat_interval_ms": args.heartbeat_interval_ms,
            "worker_procs": procs,
            "grpc_experiments": args.grpc_experiments,
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "latency": "per replica and step: from the last replica's request send to this replica's answer "
            "received; server_*: from the coordinator receiving that last request to handing this "
            "answer to gRPC (histogram bucket bound); floor_*: the same clients against a bare "
            "grpcio server that answers each step at once (no quorum logic), in the same run",
        }
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_floor_server(sys.argv[2:]) if sys.argv[1:2] == ["floor"] else _worker(sys.argv[1:]))
