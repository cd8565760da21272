"""`ftjax coordinator`: the job's coordinator as a process. Parses its options (one flag per field of
the config's `coordinator:` section), serves until a signal or the end of the job
(ftjax/coordinator/lifetime.py), and tells whoever started it where it listens (--ready-file)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from ftjax.base import net
from ftjax.base.env import TOKEN_ENV, read_token
from ftjax.base.net import ADVERTISE_ENV, BIND_ENV
from ftjax.base.tls import add_tls_arguments, tls_of
from ftjax.config import CoordinatorConfig, flag_name
from ftjax.coordinator.collector import quiet_garbage_collector
from ftjax.coordinator.lifetime import JobEnd, watch
from ftjax.coordinator.quorum import RECONNECT_WINDOW_S, Settings
from ftjax.coordinator.server import CoordinatorServer


def write_ready_file(path: str, addresses: dict[str, str]) -> None:
    """Tell whoever started this server where it listens: `addresses` plus this pid, as JSON."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({**addresses, "pid": os.getpid()}, f)
    os.replace(tmp, path)  # readers never see a half-written file


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftjax coordinator", description="The job's coordinator: gRPC quorum service plus HTTP status."
    )
    p.add_argument(
        "--host", default=None, help=f"address to bind (default: ${BIND_ENV}, else every interface, IPv6 and IPv4)"
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help=f"host the replicas dial, printed and written to --ready-file (default: "
        f"${ADVERTISE_ENV}, else --host when it names one address, else this machine's address)",
    )
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: the OS picks)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP status port (0: the OS picks, -1: none)")
    # the settings: one flag per field of the config's `coordinator:` section, with its default
    for name, field in CoordinatorConfig.model_fields.items():
        p.add_argument(
            flag_name(name),
            type=field.annotation,  # type: ignore[arg-type]  # (the section's fields are int, float, bool, str)
            default=field.default,
            help=f"{field.description} (default: %(default)s)",
        )
    p.add_argument(
        "--expected-replicas",
        type=int,
        default=0,
        help="at job start, wait for this many replicas (up to --startup-timeout-s) before the first quorum",
    )
    p.add_argument(
        "--startup-grace-s",
        type=float,
        default=None,
        help="listen this long before forming the first quorum (default: the heartbeat timeout, at least "
        f"a client's longest reconnect wait, {RECONNECT_WINDOW_S:g} s)",
    )
    p.add_argument("--token-file", default=None, help=f"file holding the job token (default: ${TOKEN_ENV})")
    add_tls_arguments(p)
    p.add_argument("--ready-file", default=None, help="write the bound addresses here as JSON once serving")
    p.add_argument(
        "--tensorboard-dir",
        default=None,
        help="write the job view (quorums, failures, catch-ups) as TensorBoard event files here, "
        "RUN/tensorboard/job/ in a job (default: none)",
    )
    p.add_argument(
        "--final-step",
        type=int,
        default=None,
        help="the job's last step: exit 0 once every expected replica reached it and none is alive "
        "(a coordinator on a cluster ends with its job)",
    )
    p.add_argument(
        "--idle-exit-s",
        type=float,
        default=None,
        help="exit 3 when no replica has been alive for this long after one joined (the job is gone)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        token = read_token(args.token_file)
        settings = Settings(
            **{name: getattr(args, name) for name in CoordinatorConfig.model_fields},
            expected_replicas=args.expected_replicas,
        )
        tls = tls_of(args)
    except (OSError, ValueError) as e:  # the config's checks raise ConfigError, a ValueError
        print(f"ftjax coordinator: {e}", file=sys.stderr)
        return 2
    host = args.host if args.host is not None else os.environ.get(BIND_ENV, "")
    advertise = args.advertise_host or os.environ.get(ADVERTISE_ENV, "").strip() or None
    server = CoordinatorServer(
        settings,
        token,
        host=host,
        port=args.port,
        advertise=advertise,
        http_port=None if args.http_port < 0 else args.http_port,
        startup_grace=args.startup_grace_s,
        tensorboard_dir=args.tensorboard_dir,
        tls=tls,
    )
    if args.final_step is not None and (args.final_step < 1 or args.expected_replicas < 1):
        print("ftjax coordinator: --final-step needs a step >= 1 and --expected-replicas", file=sys.stderr)
        return 2
    if args.idle_exit_s is not None and not args.idle_exit_s > 0:
        print(f"ftjax coordinator: --idle-exit-s must be > 0 (got {args.idle_exit_s})", file=sys.stderr)
        return 2
    stop = threading.Event()
    ended: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except (RuntimeError, OSError) as e:
        print(f"ftjax coordinator: {e}", file=sys.stderr)
        return 1
    quiet_garbage_collector()
    line = (
        f"coordinator listening grpc={server.address} http={server.http_address or '-'} "
        f"(bound to {net.describe_bind(server.bind_host)})"
    )
    print(line, flush=True)
    if args.ready_file:
        write_ready_file(args.ready_file, {"grpc": server.address, "http": server.http_address})
    if args.final_step is not None or args.idle_exit_s is not None:

        def end(code: int, why: str) -> None:
            print(f"ftjax coordinator: {why}; exiting with {code}", flush=True)
            ended.append(code)
            stop.set()

        watch(JobEnd(args.expected_replicas, args.final_step, args.idle_exit_s), server.state.snapshot, end, stop=stop)
    stop.wait()
    server.stop()
    return ended[0] if ended else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
