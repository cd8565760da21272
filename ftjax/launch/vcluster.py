"""A virtual cluster on one Linux machine: hosts that share nothing but a network.

Every virtual host is a network namespace of its own (its own loopback, one `eth0` with an address
on a private subnet), joined to the others by a veth pair onto one bridge, which lives in a
namespace of its own too: nothing is added to the machine's own namespace (no interface, address
or route), so the cluster cannot disturb the machine's network nor collide with another cluster.
Each process started on a host also gets a mount namespace with a private, empty `/dev/shm` and a
private temp dir (`$TMPDIR`, both RAM-backed tmpfs), so processes on two hosts cannot meet through
shared memory or files there, and a UTS namespace: the host's name is its hostname, and its
`/etc/hosts` maps every host's name to its address (as a cluster's DNS does; libraries that find
their own address from the hostname, as gloo does, find the host's, not loopback). The rest of
the filesystem (the run directory the launcher reads, the venv, the compilation cache) stays
shared, like a cluster's network filesystem.

    cluster = VirtualCluster(["coord", "r0h0", "r1h0"]).create()
    argv = cluster.command("r0h0", ["python", "-m", "ftjax", "train", ...])   # run it on r0h0
    cluster.cut(["r1h0"]); cluster.restore(["r1h0"])   # a partition: the host's link is cut
    cluster.limit(["r1h0"], mbit=100)                    # cap its bandwidth (tc tbf, both ways)
    cluster.close()                                      # deletes every namespace it made

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), `ip` (iproute2), `unshare` (util-linux) and, to
cap bandwidth, `tc`. `unavailable()` says why a machine cannot. A process a host runs is
`ip netns exec NS unshare -m -u sh -c 'set the hostname; mount /etc/hosts, and tmpfs on /dev/shm
and $TMPDIR; exec "$@"' ARGV`: every step execs, so the process keeps the pid the caller started
(and its process group), and dies with it: nothing of it outlives a kill.

**Partitions** detach the host's veth from the bridge (`ip link set vX nomaster`): both ends stay
up, the host keeps its address and routes, and its packets go nowhere, as when a switch between
machines drops everything. Peers learn of it only by timeouts, the worst case for failure
detection (a link taken down would tell the host's own kernel at once: no carrier). The machines
this was written on have no iptables or nft, and netem is missing; detaching needs neither.
Restoring puts the veth back on the bridge: connections that survived the silence resume.

**Bandwidth caps** are `tc qdisc ... root tbf` on both ends of the host's veth pair: on `eth0`
inside the host (what it sends) and on the bridge's end (what it receives).

Names: every namespace is `ftjv<pid>-<n>-<host>` (pid of the creating process, n a counter), so
parallel clusters never clash; `remove_stale` deletes those of processes that are gone (a
launcher killed with SIGKILL cannot clean up). The subnet is a 10.x.y.0/24 (and fd74:x:y::/64)
that overlaps no address or route of the machine's own namespace, so an address in a log names
one host without doubt.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ftjv"
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+-")
BRIDGE = "br0"
MAX_HOSTS = 250  # hosts .1 .. .250 of a /24
_counter = 0

# Runs in the host's namespaces just before the process itself: its own hostname (which its
# /etc/hosts resolves to its address, as a cluster's DNS would), a private /dev/shm and temp dir.
_PRIVATE_MOUNTS = (
    "echo {name} > /proc/sys/kernel/hostname && mount --bind {hosts} /etc/hosts && "
    "mount -t tmpfs -o mode=1777 ftjax-shm /dev/shm && mount -t tmpfs -o mode=1777 ftjax-tmp {tmp} && "
    'export TMPDIR={tmp} && exec "$@"'
)


class VirtualClusterError(RuntimeError):
    """A namespace, link or queue could not be made or changed; the message has the command's error."""


def unavailable() -> str | None:
    """Why this machine cannot make a virtual cluster (None: it can). Tries the real thing: a
    network namespace and a mount namespace, both removed at once."""
    if os.geteuid() != 0:
        return "not root (network and mount namespaces need root)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(
            ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            return f"`ip link add ... type veth` failed: {r.stderr.strip()}"
        r = subprocess.run(["ip", "-n", probe, "link", "add", "b0", "type", "bridge"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"`ip link add ... type bridge` failed: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`unshare -m` with a private /dev/shm failed: {r.stderr.strip()}"
    return None


def bandwidth_unavailable() -> str | None:
    """Why bandwidth caps cannot work here (None: they can): `tc` with the tbf qdisc."""
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2)"
    return None


def _run(argv: Sequence[str]) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise VirtualClusterError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _has_processes(ns: str) -> bool:
    """Whether processes still run in network namespace `ns` (then it is not stale, whoever made it)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return r.returncode == 0 and bool(r.stdout.strip())


def namespaces() -> list[str]:
    """Every network namespace name on this machine."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete the namespaces (and temp dirs) of virtual clusters whose creating process is gone and in
    which no process runs; returns the namespaces deleted. Those of live processes (parallel runs)
    are left alone."""
    gone = [
        ns
        for ns in namespaces()
        if (m := _NAME.match(ns)) and not _pid_alive(int(m.group(1))) and not _has_processes(ns)
    ]
    for ns in gone:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        m = re.match(rf"^{PREFIX}(\d+)-", d.name)
        if m and d.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    return gone


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every subnet this machine's own namespace has an address in or a route to."""
    nets: list = []
    for cmd in (
        ["ip", "-j", "addr"],
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        ["ip", "-j", "-6", "route", "show", "table", "all"],
    ):
        try:
            data = json.loads(_run(cmd) or "[]")
        except (VirtualClusterError, json.JSONDecodeError):
            continue
        for entry in data:
            found = [(a.get("local"), a.get("prefixlen")) for a in entry.get("addr_info", [])]
            if entry.get("dst") not in (None, "default"):
                dst = entry["dst"]
                found.append((dst.split("/")[0], dst.split("/")[1] if "/" in dst else None))
            for addr, plen in found:
                if not addr:
                    continue
                try:
                    nets.append(ipaddress.ip_network(f"{addr}/{plen}" if plen is not None else addr, strict=False))
                except ValueError:
                    pass
    return nets


def choose_subnet(seed: int, used: Iterable | None = None) -> tuple[ipaddress.IPv4Network, ipaddress.IPv6Network]:
    """A 10.x.y.0/24 and fd74:x:y::/64 pair that overlaps none of `used` (default: this machine's
    addresses and routes), starting from one derived from `seed` (a pid: parallel clusters start
    apart, though their namespaces could share one anyway)."""
    used = _used_networks() if used is None else list(used)
    for i in range(65536):
        k = (seed * 7919 + i) % 65536
        x, y = k >> 8, k & 0xFF
        v4 = ipaddress.IPv4Network(f"10.{x}.{y}.0/24")
        v6 = ipaddress.IPv6Network(f"fd74:{x:x}:{y:x}::/64")
        if not any((n.version == 4 and n.overlaps(v4)) or (n.version == 6 and n.overlaps(v6)) for n in used):
            return v4, v6
    raise VirtualClusterError("no free 10.x.y.0/24 subnet: this machine routes all of 10.0.0.0/8")


@dataclass(frozen=True)
class VirtualHost:
    name: str  # "coord", "r0h1", ...: the caller's (its hostname too)
    netns: str  # its network namespace
    veth: str  # the bridge's end of its link (in the bridge's namespace)
    ipv4: str
    ipv6: str | None
    tmp: Path  # its $TMPDIR: a private tmpfs inside its processes' mount namespace


class VirtualCluster:
    """Hosts (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, hosts: Sequence[str], *, ipv6: bool = False) -> None:
        global _counter
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: expected distinct names, got {list(hosts)}")
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"a virtual cluster has at most {MAX_HOSTS} hosts (asked for {len(hosts)})")
        for name in hosts:
            if not re.fullmatch(r"[a-z0-9]{1,12}", name):
                raise ValueError(f"host name {name!r}: 1 to 12 lowercase letters and digits")
        _counter += 1
        self.prefix = f"{PREFIX}{os.getpid()}-{_counter}-"
        self.ipv6 = ipv6
        self.bridge_ns = f"{self.prefix}br"
        self._names = list(hosts)
        self.hosts: dict[str, VirtualHost] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.subnet6: ipaddress.IPv6Network | None = None
        self.no_ipv6: str | None = None  # why IPv6 addresses could not be added (when asked for)
        self.state_dir: Path | None = None
        self._made: list[str] = []  # namespaces created, deleted in reverse by close()
        self._limited: set[tuple[str, str]] = set()

    # --- making and unmaking ------------------------------------------------------------------------
    def create(self) -> VirtualCluster:
        """Make the bridge and every host; on any error, undo what was made and raise."""
        try:
            remove_stale()
            self.subnet, self.subnet6 = choose_subnet(os.getpid())
            self.state_dir = Path(tempfile.mkdtemp(prefix=self.prefix))
            self._add_netns(self.bridge_ns)
            _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", "lo", "up"])
            for i, name in enumerate(self._names, start=1):
                self._add_host(name, i)
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
            lines += [f"{h.ipv4} {h.name}" for h in self.hosts.values()]
            (self.state_dir / "hosts").write_text("\n".join(lines) + "\n")
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)

    def _add_host(self, name: str, i: int) -> None:
        ns, veth = f"{self.prefix}{name}", f"v{name}"
        assert self.subnet is not None and self.subnet6 is not None and self.state_dir is not None  # (create())
        ipv4 = str(self.subnet[i])
        ipv6 = str(self.subnet6[i]) if self.ipv6 else None
        self._add_netns(ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "-n", self.bridge_ns, "link", "set", veth, "master", BRIDGE, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ipv4}/{self.subnet.prefixlen}", "dev", "eth0"])
        if ipv6 is not None:
            try:
                _run(["ip", "-n", ns, "addr", "add", f"{ipv6}/{self.subnet6.prefixlen}", "dev", "eth0", "nodad"])
            except VirtualClusterError as e:  # a kernel without IPv6: IPv4 still works
                self.no_ipv6, ipv6 = str(e), None
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        tmp = self.state_dir / name / "tmp"
        tmp.mkdir(parents=True)
        self.hosts[name] = VirtualHost(name, ns, veth, ipv4, ipv6, tmp)

    def close(self) -> None:
        """Delete every namespace this cluster made (their links and queues go with them) and its
        state dir. Processes still inside a namespace keep it alive, unnamed, until they exit: kill
        them first. Safe to call twice."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None

    def __enter__(self) -> VirtualCluster:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- running on a host ----------------------------------------------------------------------------
    def host(self, name: str) -> VirtualHost:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no virtual host {name!r} (hosts: {', '.join(self.hosts)})") from None

    def address(self, name: str, family: int = 4) -> str:
        """The host's address (family 4 or 6)."""
        h = self.host(name)
        if family == 6:
            if h.ipv6 is None:
                raise VirtualClusterError(f"host {name} has no IPv6 address ({self.no_ipv6 or 'not asked for'})")
            return h.ipv6
        return h.ipv4

    def command(self, name: str, argv: Sequence[str], *, private: bool = True) -> list[str]:
        """The command that runs `argv` on host `name`: in its network namespace and, if `private`,
        in a mount namespace of its own with an empty /dev/shm and temp dir ($TMPDIR is set to it).
        Each step execs: the process keeps the pid it was started with."""
        h = self.host(name)
        wrap = ["ip", "netns", "exec", h.netns]
        if private:
            assert self.state_dir is not None, "the cluster is closed"
            script = _PRIVATE_MOUNTS.format(
                name=name, hosts=shlex.quote(str(self.state_dir / "hosts")), tmp=shlex.quote(str(h.tmp))
            )
            wrap += ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script, f"ftjax-{name}"]
        return [*wrap, *argv]

    def enter(self, name: str) -> None:
        """Move the calling thread, and only it, into host `name`'s network namespace: the sockets
        it opens from now on are that host's (the launcher's view reads the coordinator's status
        page this way; the launcher itself stays outside the cluster's network)."""
        enter_network_namespace(self.host(name).netns)

    # --- faults -------------------------------------------------------------------------------------
    def cut(self, names: Iterable[str]) -> None:
        """Cut the hosts' links: their packets go nowhere until `restore` (see the module docstring)."""
        for name in names:
            _run(["ip", "-n", self.bridge_ns, "link", "set", self.host(name).veth, "nomaster"])

    def restore(self, names: Iterable[str]) -> None:
        for name in names:
            _run(["ip", "-n", self.bridge_ns, "link", "set", self.host(name).veth, "master", BRIDGE])

    def is_cut(self, name: str) -> bool:
        out = _run(["ip", "-j", "-n", self.bridge_ns, "link", "show", self.host(name).veth])
        return json.loads(out)[0].get("master") != BRIDGE

    def limit(self, names: Iterable[str], mbit: float) -> None:
        """Cap the hosts' bandwidth at `mbit` megabits per second each way (tc tbf on both ends)."""
        if not mbit > 0:
            raise ValueError(f"mbit: expected > 0, got {mbit}")
        rate = f"{int(mbit * 1000)}kbit"
        # tbf's bucket must hold a whole (GSO) packet and one timer tick of traffic; the queue holds
        # 50 ms of it. Smaller buckets starve TCP of its bursts.
        burst = max(int(mbit * 1e6 / 8 / 100), 1 << 17)
        for name in names:
            h = self.host(name)
            for ns, dev in ((h.netns, "eth0"), (self.bridge_ns, h.veth)):
                verb = "change" if (ns, dev) in self._limited else "add"
                _run(
                    [
                        "tc",
                        "-n",
                        ns,
                        "qdisc",
                        verb,
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        str(burst),
                        "latency",
                        "50ms",
                    ]
                )
                self._limited.add((ns, dev))


CLONE_NEWNET = 0x40000000


def enter_network_namespace(netns: str) -> None:
    """setns(2) the calling thread into the named network namespace (`ip netns` names it under
    /var/run/netns). A thread's network namespace is its own: the process's other threads stay
    where they were. (os.setns arrives with Python 3.12; ctypes until then.)"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise VirtualClusterError(f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)
