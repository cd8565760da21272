"""`ftjax bench ftar --world N --mib M`: FTAR bus bandwidth against the raw TCP link, same run.

Starts N member processes on 127.0.0.1 (and N more whose links are TCP only), warms up, then runs
``--rounds`` rounds, each of: raw TCP yardsticks, then ``--iters`` back-to-back all-reduces of M MiB
float32 on each set of members. Interleaving puts every figure under the same background load of
this shared machine. Prints one JSON line (GB/s = 1e9 bytes per second; times are medians over the
rounds):

    busbw_gbps      2 (N-1)/N * bytes / all-reduce time (the slowest member's; the first call of
                    each round, which absorbs the members' start skew, is not timed), as FTAR runs
                    by default: links between members on one host carry payloads through shared
                    memory (``shm_links`` counts them; the frame headers stay on TCP)
    link_gbps       one-way TCP throughput between two members, M MiB walked through in chunk-size
                    sendall / recv_into(MSG_WAITALL) calls on both sides
    ratio           busbw_gbps / link_gbps
    link_hot_gbps   the same, resending one chunk and receiving into one chunk: cache-hot copies,
                    an upper bound no transfer of M MiB meets; ratio_hot = busbw_gbps / link_hot_gbps
    busbw_tcp_gbps  the same all-reduces with shared memory switched off: every payload over
                    loopback TCP; ratio_tcp = busbw_tcp_gbps / link_gbps
    pattern_gbps    the all-reduce's traffic without FTAR: every member sends 2 (N-1)/N * M MiB of
                    raw TCP to its right neighbour while receiving as much from its left one;
                    ratio_pattern = busbw_tcp_gbps / pattern_gbps (how close FTAR's TCP links get
                    to what this machine does for the same traffic)

``--virtual-cluster``: each member runs on a virtual host of its own (`ftjax.launch.vcluster`: a
network namespace on a bridge, a private /dev/shm), so the members share nothing but the network,
as on a cluster: their links are TCP between two addresses on the bridge, the shared-memory
offer is declined (``shm_links`` is 0) and there is no TCP-only set (every link is one already).
``link_gbps`` is then raw TCP between the same namespaces, in the same run, and ``ratio`` is FTAR's
busbw against it (``pattern_gbps`` / ``ratio_pattern`` likewise, against busbw_gbps).
``--bandwidth-mbit B`` caps every member's host at B megabits per second each way (tc tbf).

``--streams 1,2,4`` and ``--wire-dtypes float32,bfloat16`` (or ``--wire-dtype``): the same run also
measures FTAR with every combination of TCP connections per link (ft.link_streams) and wire dtype
(ft.wire_dtype; each member holds one endpoint per setting, and each round runs them all), and raw
TCP over as many parallel connections between the same two members. ``settings`` lists, per
combination, ``busbw_gbps`` (always in bytes of the float32 buffer averaged: a bfloat16 wire moves
half of them), ``link_gbps`` (raw TCP, same streams, one way), ``ratio`` (busbw / link),
``pattern_gbps`` / ``ratio_pattern`` (the ring's traffic as raw TCP over as many streams: both
directions at once, which is what bounds FTAR where the CPUs, not the network, are the limit) and,
for a bfloat16 wire, ``vs_float32_wire`` (its busbw over the float32 wire's, same streams);
``best`` is the combination with the highest busbw. The top-level figures are those of the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import statistics
import sys

from ftjax.base.procs import ProcessGroup
from ftjax.ftar.endpoint import DEFAULT_CHUNK_BYTES
from ftjax_bench.ftar_member import MemberClient, start_members


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ftjax bench ftar", description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="number of member processes (>= 2)")
    ap.add_argument("--mib", type=float, default=64.0, help="buffer size in MiB (float32)")
    ap.add_argument("--iters", type=int, default=3, help="timed all-reduces per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of (yardsticks, all-reduces)")
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="FTAR chunk and raw TCP call size")
    ap.add_argument("--checksum", action="store_true", help="crc32 every frame")
    ap.add_argument("--no-tcp", action="store_true", help="skip the TCP-only all-reduces (busbw_tcp_gbps)")
    ap.add_argument("--json", action="store_true", help="accepted for uniformity: the output is always one JSON line")
    ap.add_argument("--streams", type=_ints, default=[1], help="TCP connections per link to compare, e.g. 1,2,4")
    ap.add_argument(
        "--wire-dtypes",
        "--wire-dtype",
        dest="wire_dtypes",
        type=_words,
        default=["float32"],
        help="FTAR wire dtypes to compare: float32, bfloat16 or both (comma-separated)",
    )
    ap.add_argument(
        "--virtual-cluster",
        action="store_true",
        help="each member on a virtual host of its own (network and mount namespaces; Linux, root)",
    )
    ap.add_argument(
        "--bandwidth-mbit",
        type=float,
        default=None,
        metavar="B",
        help="with --virtual-cluster: cap every member's host at B Mbit/s each way (tc tbf)",
    )
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error("--world must be >= 2")
    if args.iters < 1 or args.rounds < 1:
        ap.error("--iters and --rounds must be >= 1")
    if args.mib <= 0 or args.chunk_bytes < 4:
        ap.error("--mib must be > 0 and --chunk-bytes >= 4")
    if not args.streams or any(not 1 <= s <= 64 for s in args.streams):
        ap.error("--streams must list counts in 1..64")
    if not args.wire_dtypes or any(w not in ("float32", "bfloat16") for w in args.wire_dtypes):
        ap.error("--wire-dtypes must list float32 and/or bfloat16")
    if args.bandwidth_mbit is not None and not (args.virtual_cluster and args.bandwidth_mbit > 0):
        ap.error("--bandwidth-mbit must be > 0 and needs --virtual-cluster")
    if args.virtual_cluster:
        from ftjax.launch.vcluster import bandwidth_unavailable, unavailable

        why = unavailable() or (bandwidth_unavailable() if args.bandwidth_mbit else None)
        if why is not None:
            ap.error(f"--virtual-cluster: this machine cannot run one: {why}")
        args.no_tcp = True  # across hosts every link is TCP already
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _settings(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(streams, wire dtype) combinations, in the order asked (duplicates dropped)."""
    return list(dict.fromkeys(itertools.product(args.streams, args.wire_dtypes)))


def _name(setting: tuple[int, str]) -> str:
    """The member's endpoint for a setting: "" (its default one) for one stream and a float32 wire."""
    return "" if setting == (1, "float32") else f"s{setting[0]}-{setting[1]}"


class _Bench:
    def __init__(self, members: list[MemberClient], args: argparse.Namespace) -> None:
        self.members, self.args = members, args
        self.n = int(args.mib * (1 << 20)) // 4
        self.nbytes = self.n * 4
        self.step = 0
        self.addresses = {"": [m.address for m in members]}  # endpoint name -> members' addresses

    def add_endpoint(self, setting: tuple[int, str]) -> str:
        """Have every member open an endpoint for ``setting`` (unless it is the default one)."""
        name = _name(setting)
        if name not in self.addresses:
            for m in self.members:
                m.send(op="endpoint", name=name, streams=setting[0], wire_dtype=setting[1])
            self.addresses[name] = [r["address"] for r in self._collect(self.members)]
        return name

    def _collect(self, members: list[MemberClient]) -> list[dict]:
        replies = [m.result() for m in members]
        for r in replies:
            if not r["ok"]:
                raise RuntimeError(f"a member failed: {r}")
        return replies

    def allreduce(
        self, iters: int, verify: bool = False, members: list[MemberClient] | None = None, endpoint: str = ""
    ) -> list[float]:
        """Per-call times (the slowest member's) of ``iters`` back-to-back all-reduces."""
        addresses = [m.address for m in members] if members is not None else self.addresses[endpoint]
        members = self.members if members is None else members
        for rank, m in enumerate(members):
            m.send(
                op="allreduce",
                endpoint=endpoint,
                quorum_id=1,
                step=self.step,
                members=addresses,
                rank=rank,
                n=self.n,
                dtype="float32",
                seeds=list(range(len(members))),
                iters=iters,
                verify=verify,
            )
        replies = self._collect(members)
        self.step += iters
        self.last_stats = [r["stats"] for r in replies]
        if verify and not all(r["exact"] for r in replies):
            raise RuntimeError(f"the all-reduce result is wrong: {replies}")
        return [max(ts) for ts in zip(*(r["times"] for r in replies))]

    def link(self, spread: bool, streams: int = 1) -> float:
        src, dst = self.members[0], self.members[1]
        common = dict(op="raw", nbytes=self.nbytes, chunk=self.args.chunk_bytes, spread=spread, streams=streams)
        dst.send(send_to=None, receive=True, **common)
        src.send(send_to=dst.raw_address, receive=False, **common)
        seconds = self._collect([src])[0]["seconds"]
        self._collect([dst])
        return seconds

    def pattern(self, streams: int = 1) -> float:
        world = len(self.members)
        per_member = 2 * (world - 1) * self.nbytes // world
        for rank, m in enumerate(self.members):
            m.send(
                op="raw",
                send_to=self.members[(rank + 1) % world].raw_address,
                receive=True,
                nbytes=per_member,
                chunk=self.args.chunk_bytes,
                spread=True,
                streams=streams,
            )
        return max(r["seconds"] for r in self._collect(self.members))


def _start(group: ProcessGroup, args: argparse.Namespace) -> tuple[_Bench, list[MemberClient]]:
    """The members (on a virtual cluster's hosts with ``--virtual-cluster``) and the TCP-only set."""
    token = secrets.token_hex(16)
    cluster = hosts = None
    if args.virtual_cluster:
        from ftjax.launch.vcluster import VirtualCluster

        hosts = [f"m{i}" for i in range(args.world)]
        cluster = VirtualCluster(hosts)
        group.on_close(cluster.close)  # after the members are killed
        cluster.create()
        if args.bandwidth_mbit:
            cluster.limit(hosts, args.bandwidth_mbit)
    common = dict(chunk_bytes=args.chunk_bytes, checksum=args.checksum)
    bench = _Bench(start_members(group, args.world, token, **common, cluster=cluster, hosts=hosts), args)
    tcp = [] if args.no_tcp else start_members(group, args.world, token, **common, shared_memory=False)
    return bench, tcp


def _rounds(bench: _Bench, tcp: list[MemberClient], args: argparse.Namespace) -> tuple[dict, int]:
    """Warm up, then ``--rounds`` rounds of every yardstick and setting; (times by name, shm links)."""
    names = {setting: bench.add_endpoint(setting) for setting in _settings(args)}
    for name in names.values():  # warm-up: dials the ring, touches the buffers, checks the result
        bench.allreduce(1, verify=True, endpoint=name)
    shm_links = sum(s["shm_dials"] for s in bench.last_stats)
    if tcp:
        bench.allreduce(1, verify=True, members=tcp)
    streams = sorted({s for s, _ in names})
    for count in streams:  # warm-up: touches the yardsticks' buffers
        bench.link(True, count)
    bench.link(False), bench.pattern()
    times: dict[str, list[float]] = {"allreduce": [], "allreduce_tcp": [], "link": [], "link_hot": []}
    for _ in range(args.rounds):
        for count in streams:
            times.setdefault(f"link_s{count}", []).append(bench.link(True, count))
        times["link_hot"].append(bench.link(False))
        for count in sorted({1, *streams}):
            times.setdefault(f"pattern_s{count}", []).append(bench.pattern(count))
        for (count, wire_dtype), name in names.items():
            took = bench.allreduce(args.iters + 1, endpoint=name)[1:]
            times.setdefault(f"allreduce_s{count}-{wire_dtype}", []).extend(took)
        if tcp:
            times["allreduce_tcp"] += bench.allreduce(args.iters + 1, members=tcp)[1:]
    count, wire_dtype = next(iter(names))
    times["allreduce"], times["link"] = times[f"allreduce_s{count}-{wire_dtype}"], times[f"link_s{count}"]
    times["pattern"] = times["pattern_s1"]
    for m in bench.members + tcp:
        m.send(op="exit")
    return times, shm_links


def _per_setting(args: argparse.Namespace, med: dict[str, float], bus: float, nbytes: int) -> list[dict]:
    """One record per (streams, wire dtype): busbw in float32 bytes, raw TCP over as many streams."""
    out = []
    for streams, wire_dtype in _settings(args):
        busbw = bus / med[f"allreduce_s{streams}-{wire_dtype}"]
        link = nbytes / med[f"link_s{streams}"] / 1e9
        rec = {"streams": streams, "wire_dtype": wire_dtype, "busbw_gbps": round(busbw, 3)}
        rec |= {"link_gbps": round(link, 3), "ratio": round(busbw / link, 3)}
        pattern = bus / med[f"pattern_s{streams}"]  # both directions at once, as the ring moves them
        rec |= {"pattern_gbps": round(pattern, 3), "ratio_pattern": round(busbw / pattern, 3)}
        fp32 = f"allreduce_s{streams}-float32"
        if wire_dtype == "bfloat16" and fp32 in med:
            rec["vs_float32_wire"] = round(med[fp32] / med[f"allreduce_s{streams}-bfloat16"], 3)
        out.append(rec)
    return out


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark described in the module docstring; returns its JSON record."""
    with ProcessGroup() as group:
        bench, tcp = _start(group, args)
        times, shm_links = _rounds(bench, tcp, args)
    nbytes, world = bench.nbytes, args.world
    med = {k: statistics.median(v) for k, v in times.items() if v}
    bus = 2 * (world - 1) / world * nbytes / 1e9  # GB each member sends per all-reduce (float32)
    busbw = bus / med["allreduce"]
    link, hot = nbytes / med["link"] / 1e9, nbytes / med["link_hot"] / 1e9
    pattern = bus / med["pattern"]
    settings = _per_setting(args, med, bus, nbytes)
    record = {
        "bench": "ftar",
        "world": world,
        "mib": args.mib,
        "busbw_gbps": round(busbw, 3),
        "link_gbps": round(link, 3),
        "ratio": round(busbw / link, 3),
        "median_s": round(med["allreduce"], 5),
        "shm_links": shm_links,
        "settings": settings,
        "best": max(settings, key=lambda r: r["busbw_gbps"]),
    }
    if args.virtual_cluster:
        record |= {
            "virtual_cluster": True,
            "bandwidth_mbit": args.bandwidth_mbit,
            "pattern_gbps": round(pattern, 3),
            "ratio_pattern": round(busbw / pattern, 3),
        }
    if tcp:
        busbw_tcp = bus / med["allreduce_tcp"]
        record |= {
            "busbw_tcp_gbps": round(busbw_tcp, 3),
            "ratio_tcp": round(busbw_tcp / link, 3),
            "pattern_gbps": round(pattern, 3),
            "ratio_pattern": round(busbw_tcp / pattern, 3),
        }
    return record | {
        "link_hot_gbps": round(hot, 3),
        "ratio_hot": round(busbw / hot, 3),
        "chunk_bytes": args.chunk_bytes,
        "checksum": args.checksum,
        "times_s": {k: [round(t, 5) for t in v] for k, v in times.items()},
    }


def main(argv: list[str]) -> int:
    """Entry point of `ftjax bench ftar`."""
    print(json.dumps(measure(_parse(argv))))
    sys.stdout.flush()
    return 0
