"""The processes of one local job: a coordinator and R replicas of H hosts each.

`LocalJob` only starts, watches and kills processes (every one in a `ProcessGroup`, so none
survives its owner); policy (restarts, faults, views) belongs to the launcher. Tests of the step
protocol use it directly.

In a virtual cluster (`cluster`, `ftjax.launch.vcluster`) every process runs on a host of its own:
the coordinator on host `coord`, host h of replica r on `r<r>h<h>`, each in its own network namespace
(its own address, its own loopback) with a private /dev/shm and temp dir. The coordinator then
binds every interface of its host and advertises that host's address, so every replica process
advertises its own host's address (the source of its route to the coordinator, `ftjax.base.net`), and a
replica's `jax.distributed` service is dialled at its host 0's address. The run directory stays on
the shared filesystem: it is the launcher's view of the job.

Layout of the run directory:
    RUN/coordinator.log, RUN/coordinator.json (its bound addresses)
    RUN/replica-R/metrics.jsonl, summary.json  (written by the replica's leader)
    RUN/replica-R/host-H.log                   (each host's output, all incarnations appended)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from ftjax.base.env import TOKEN_ENV
from ftjax.base.net import format_address, split_address
from ftjax.base.procs import ProcessGroup, free_port
from ftjax.base.tls import TLS
from ftjax.config import Config, load_config

if TYPE_CHECKING:
    from ftjax.launch.vcluster import VirtualCluster


COORDINATOR_HOST = "coord"  # the coordinator's host in a virtual cluster


def host_name(r: int, h: int) -> str:
    """The virtual host that runs host h of replica r."""
    return f"r{r}h{h}"


def job_hosts(replicas: int, hosts: int) -> list[str]:
    """Every virtual host of a job: the coordinator's, then each replica's."""
    return [COORDINATOR_HOST, *(host_name(r, h) for r in range(replicas) for h in range(hosts))]


FTJAX = (sys.executable, "-m", "ftjax")  # the ftjax command line of this interpreter


class LocalJob:
    def __init__(
        self,
        config_path: str | Path,
        overrides: list[str],
        out: str | Path,
        *,
        replicas: int,
        procs: ProcessGroup,
        token: str | None = None,
        extra_env: dict[str, str] | None = None,
        cluster: VirtualCluster | None = None,
        entry: list[str] | None = None,
        tls: TLS | None = None,
    ):
        self.config_path = str(config_path)
        self.tls_flags = tls.flags() if tls is not None else []  # the coordinator's and every replica's
        self.entry = entry or [*FTJAX, "train"]  # what runs each replica host
        self.overrides = [*overrides, f"ft.replicas={replicas}"]
        self.cfg: Config = load_config(self.config_path, self.overrides)  # validated before anything starts
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.replicas = replicas
        self.procs = procs
        self.token = token or secrets.token_hex(16)
        self.env = {TOKEN_ENV: self.token, **(extra_env or {})}
        self.coordinator: subprocess.Popen | None = None
        self.coordinator_address: str | None = None
        self.coordinator_http: str | None = None
        self.hosts: dict[int, list[subprocess.Popen]] = {}  # replica -> its processes, by process id
        self.placement: dict[int, list[int]] = {}  # replica -> the host each of its processes runs on
        self.incarnations: dict[int, int] = {}
        self.cluster = cluster  # a virtual cluster (every process on a host of its own), or None: this machine
        self.cpus: dict[int, Collection[int]] = {}  # replica -> the cores its processes may use (none: any)

    def host_name(self, r: int, h: int) -> str:
        return host_name(r, h)

    def host_names(self, r: int) -> list[str]:
        return [host_name(r, h) for h in range(self.cfg.mesh.hosts)]

    def _on(self, host: str, argv: list[str]) -> list[str]:
        """`argv` as run on `host`: on its virtual host in a virtual cluster, else as is."""
        return self.cluster.command(host, argv) if self.cluster is not None else argv

    # --- coordinator -----------------------------------------------------------------------------
    def start_coordinator(self, timeout: float = 30.0, port: int = 0, http_port: int = 0) -> str:
        ready = self.out / "coordinator.json"
        ready.unlink(missing_ok=True)
        log = open(self.out / "coordinator.log", "a")
        # A job on this machine: the coordinator listens on loopback only, and so (following their
        # route to it) do the replicas. In a virtual cluster: every interface of its host, and it
        # advertises the host's address.
        where = (
            ["--advertise-host", self.cluster.address(COORDINATOR_HOST)]
            if self.cluster is not None
            else ["--host", "127.0.0.1"]
        )
        self.coordinator = self.procs.start(
            self._on(
                COORDINATOR_HOST,
                [
                    *FTJAX,
                    "coordinator",
                    *where,
                    "--port",
                    str(port),
                    "--http-port",
                    str(http_port),
                    *self.cfg.coordinator.flags(),
                    "--expected-replicas",
                    str(self.replicas),
                    "--ready-file",
                    str(ready),
                    *self._job_view_flags(),
                    *self.tls_flags,
                ],
            ),
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.coordinator.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator not ready after {timeout} s; see {log.name}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.coordinator_address, self.coordinator_http = info["grpc"], info.get("http")
        return self.coordinator_address

    def _job_view_flags(self) -> list[str]:
        """The coordinator's TensorBoard view of the job: RUN/tensorboard/job/, beside the replicas'."""
        return ["--tensorboard-dir", str(self.out / "tensorboard" / "job")] if self.cfg.log.tensorboard else []

    def restart_coordinator(self, timeout: float = 30.0) -> str:
        """Kill the coordinator and start a new one on the same ports (its state is soft)."""
        assert self.coordinator is not None and self.coordinator_address is not None, "no coordinator started"
        port = split_address(self.coordinator_address)[1]
        http_port = split_address(self.coordinator_http)[1] if self.coordinator_http else 0
        self.procs.kill(self.coordinator)
        self.coordinator.wait(10)
        deadline = time.monotonic() + timeout
        while True:  # the port can linger for a moment after the kill
            try:
                return self.start_coordinator(timeout=timeout, port=port, http_port=http_port)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # --- replicas --------------------------------------------------------------------------------
    def replica_dir(self, r: int) -> Path:
        return self.out / f"replica-{r}"

    def start_replica(
        self,
        r: int,
        *,
        die_at: str | None = None,
        die_host: int = 0,
        extra_args: list[str] | None = None,
        on_hosts: list[int] | None = None,
    ) -> list[subprocess.Popen]:
        """Start replica r's host processes (a new incarnation): one on each of its H hosts, or on
        `on_hosts` only, a reduced-degree replica (`mesh.live_hosts`, docs/design/index.md). Process i
        runs on host `on_hosts[i]`; `die_host` names a process."""
        if self.coordinator_address is None:
            raise RuntimeError("start the coordinator first")
        hosts = self.cfg.mesh.hosts
        on_hosts = list(range(hosts)) if on_hosts is None else list(on_hosts)
        reduced = [f"mesh.live_hosts={len(on_hosts)}"] if len(on_hosts) < hosts else []
        rdir = self.replica_dir(r)
        rdir.mkdir(parents=True, exist_ok=True)
        # the replica's jax.distributed service: on its process 0
        leader = self.cluster.address(host_name(r, on_hosts[0])) if self.cluster is not None else "127.0.0.1"
        dist = ["--dist-address", format_address(leader, free_port())] if len(on_hosts) > 1 else []
        self.incarnations[r] = self.incarnations.get(r, 0) + 1
        children = []
        for i, h in enumerate(on_hosts):
            args = [
                *self.entry,
                self.config_path,
                *self.overrides,
                *reduced,
                "--out",
                str(rdir),
                "--replica-id",
                str(r),
                "--coordinator",
                self.coordinator_address,
                "--num-processes",
                str(hosts),
                "--process-id",
                str(i),
                *dist,
                *self.tls_flags,
                *(extra_args or []),
            ]
            if die_at and i == die_host:
                args += ["--die-at", die_at]
            children.append(self._start_host(r, h, i, len(on_hosts), args))
        self.hosts[r], self.placement[r] = children, on_hosts
        return children

    def _start_host(self, r: int, h: int, i: int, n: int, args: list[str]) -> subprocess.Popen:
        """Start `args`, process i of n, on host h of replica r; its output goes to the host's log."""
        log = open(self.replica_dir(r) / f"host-{h}.log", "a")
        try:
            log.write(f"--- incarnation {self.incarnations[r]} host {h} (process {i} of {n}) at {time.time():.3f}\n")
            log.flush()
        except OSError as e:  # a full disk: the process may still run (and say so itself); start it
            print(f"ftjax launch: cannot write {log.name} ({e.strerror}); starting it anyway", file=sys.stderr)
            with contextlib.suppress(OSError):  # (closed even when its flush fails again)
                log.close()
            log = open(log.name, "a")  # a fresh buffer: the failed line would be retried at every flush
        return self.procs.start(
            self._on(host_name(r, h), args),
            env=self.env,
            device_count=self.cfg.mesh.devices_per_host,
            stdout=log,
            stderr=subprocess.STDOUT,
            cpus=self.cpus.get(r),
        )

    def terminate_replica(self, r: int) -> None:
        """SIGTERM every process of replica r: it leaves the job at its next step boundary."""
        for p in self.hosts.get(r, []):
            self.procs.kill(p, signal.SIGTERM)

    def replica_exit_codes(self, r: int) -> list[int | None]:
        return [p.poll() for p in self.hosts.get(r, [])]

    def kill_replica(self, r: int, host: int | None = None) -> None:
        """SIGKILL one host of replica r (or all of them)."""
        for h, p in enumerate(self.hosts.get(r, [])):
            if host is None or h == host:
                self.procs.kill(p)

    def wait(self, replicas: list[int] | None = None, timeout: float = 300.0) -> dict[int, list[int]]:
        """Wait for the given replicas' processes to exit; raises TimeoutError (processes left running)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, list[int]] = {}
        for r in replicas if replicas is not None else list(self.hosts):
            codes[r] = []
            for p in self.hosts[r]:
                left = deadline - time.monotonic()
                try:
                    codes[r].append(p.wait(max(left, 0.01)))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(
                        f"replica {r} still running after {timeout} s; see {self.replica_dir(r)}"
                    ) from None
        return codes

    def log_tail(self, r: int, host: int = 0, chars: int = 3000) -> str:
        """The last `chars` characters of a host's log. Only its end is read (at most 4 bytes a
        character): the launcher asks at every crash, and a long run's log may be large."""
        path = self.replica_dir(r) / f"host-{host}.log"
        if not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
            return f.read().decode("utf-8", errors="replace")[-chars:]
