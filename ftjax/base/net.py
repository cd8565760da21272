"""Addresses: which address a process binds its listeners to, and which one it tells its peers.

Every listener of a job (a replica's FTAR endpoint and catch-up server, its `jax.distributed`
service, the coordinator's gRPC and HTTP servers) binds one host and advertises one address that
peers dial. The two differ: a process binds all interfaces, and advertises the one address of this
machine that its peers can reach.

The advertised host is, first that applies:
  1. `$FTJAX_ADVERTISE_HOST` (per process: a Kubernetes pod IP from the downward API, say);
  2. the config's `net.advertise_host`;
  3. the address of the config's `net.interface` (a Slurm node's high-speed interface, `ib0`);
  4. the source address of this machine's route to the coordinator: the address the coordinator,
     and so presumably every peer, sees this process connect from. It is read from a UDP socket
     `connect()`ed to the coordinator, which sends no packet.
A coordinator on loopback (a job on one machine) gives loopback, and only then.

The bound host is `$FTJAX_BIND_HOST`, else `net.bind_host`, else all interfaces (IPv6 and IPv4
on one dual-stack socket where the kernel has IPv6), except that a process that advertises a
loopback address binds that address only: nobody but this machine could reach it anyway.

Addresses are "host:port", an IPv6 host in brackets ("[fd00::1]:4000").
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

ADVERTISE_ENV = "FTJAX_ADVERTISE_HOST"
BIND_ENV = "FTJAX_BIND_HOST"
ALL_INTERFACES = ""  # a bind host: every interface, dual-stack where possible
_ALL = ("", "*", "::", "0.0.0.0")
_PUBLIC_PROBES = ("192.0.2.1", "2001:db8::1")  # documentation addresses: only the route is looked up


def format_address(host: str, port: int) -> str:
    """ "host:port", an IPv6 host in brackets."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def normalize_host(host: str) -> str:
    """An IP literal in its canonical form (brackets and an IPv6 scope dropped), a name as is."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ip = _ip(host)
    return str(ip) if ip is not None else host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    host = normalize_host(host)
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def is_all_interfaces(host: str) -> bool:
    return host.strip() in _ALL


def advertised(bind: str, advertise: str | None = None) -> str:
    """The host a listener bound to `bind` tells its peers: `advertise` if given, else the bound host,
    or this machine's address when it is bound to every interface (normalized either way)."""
    if advertise is None:
        advertise = host_address() if is_all_interfaces(bind) else bind
    return normalize_host(advertise)


@dataclass(frozen=True)
class Listen:
    """Where a listener binds (`host`, "" for every interface; `port` 0: the OS picks one) and the
    host its peers dial (`advertise`; default: see `advertised`)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None

    def advertised_host(self) -> str:
        return advertised(self.host, self.advertise)


def describe_bind(bind: str) -> str:
    """A bind host for a log line ("every interface" for all of them)."""
    return "every interface" if is_all_interfaces(bind) else bind


def route_source(host: str, port: int = 9) -> str:
    """The local address this machine would send from to reach `host`: the source address of a
    UDP socket `connect()`ed to it (the kernel picks the route; no packet is sent). OSError naming
    `host` if there is no route (or the name does not resolve)."""
    errors = []
    try:
        infos = socket.getaddrinfo(normalize_host(host), port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve {host!r}: {e}") from None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return normalize_host(s.getsockname()[0])
        except OSError as e:
            errors.append(f"{sockaddr[0]}: {e.strerror or e}")
    raise OSError(f"no route from this machine to {host} ({'; '.join(errors) or 'no address'})")


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 and IPv6 address on this machine (Linux), IPv4 first,
    IPv6 link-local addresses left out (they need a scope no peer shares)."""
    v4, v6 = [], []
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr:
            v4.append((name, addr))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6:
                    continue
                ip = ipaddress.IPv6Address(int(parts[0], 16))
                if not ip.is_link_local:
                    v6.append((parts[5], str(ip)))
    except OSError:
        pass
    return v4 + v6


def _ipv4_of(interface: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_address(interface: str) -> str:
    """The address of `interface` (its IPv4 address, else its first global IPv6 one); ValueError
    naming the interfaces there are if it has none."""
    found = interface_addresses()
    for name, addr in found:
        if name == interface:
            return addr
    names = sorted({name for name, _ in found})
    raise ValueError(
        f"interface {interface!r} has no address on this machine (interfaces with one: {', '.join(names) or 'none'})"
    )


def host_address() -> str:
    """This machine's address, for a process that has nobody to route to (the coordinator): the
    source of its default route, else its first address that is not loopback, else loopback."""
    for probe in _PUBLIC_PROBES:
        try:
            return route_source(probe)
        except OSError:
            pass
    for _, addr in interface_addresses():
        if not is_loopback(addr):
            return addr
    return "127.0.0.1"


@dataclass(frozen=True)
class Addresses:
    """What a process binds (`bind`: a host, "" for all interfaces) and advertises (`advertise`: the
    host peers dial), and how the advertised host was chosen (`why`, for the log)."""

    bind: str
    advertise: str
    why: str

    def address(self, port: int) -> str:
        """The address peers dial for a listener of this process on `port`."""
        return format_address(self.advertise, port)


def choose(
    toward: str | None = None,
    *,
    advertise_host: str | None = None,
    interface: str | None = None,
    bind_host: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Addresses:
    """The addresses of a process whose peers find it through `toward` (the coordinator's host, or
    None for the coordinator itself), given the config's `net` settings and the environment (see
    the module doc for the order). OSError or ValueError, naming what failed, if none can be found."""
    env = os.environ if environ is None else environ
    from_env = env.get(ADVERTISE_ENV, "").strip()
    if from_env:
        host, why = from_env, f"${ADVERTISE_ENV}"
    elif advertise_host:
        host, why = advertise_host, "net.advertise_host"
    elif interface:
        host, why = interface_address(interface), f"net.interface {interface}"
    elif toward:
        host, why = route_source(toward), f"the route to the coordinator {toward}"
    else:
        host, why = host_address(), "this machine's address"
    host = normalize_host(host)
    if not host or is_all_interfaces(host):
        raise ValueError(f"{why}: {host!r} is not an address peers can dial")
    bind_env = env.get(BIND_ENV, "").strip()
    if bind_env:
        bind = bind_env
    elif bind_host is not None:
        bind = bind_host
    elif is_loopback(host):
        bind = "127.0.0.1" if host.lower().startswith("localhost") else host
    else:
        bind = ALL_INTERFACES
    return Addresses(bind_value(bind), host, why)


def bind_value(bind: str) -> str:
    """A bind host as given ("", "*" and "::" mean every interface, both families: ""; "0.0.0.0"
    every IPv4 interface) in canonical form."""
    bind = bind.strip()
    if bind in ("", "*", "::"):
        return ALL_INTERFACES
    return normalize_host(bind)


# --- listeners ------------------------------------------------------------------------------------
def family_of(bind: str) -> socket.AddressFamily:
    """The socket family for a listener bound to `bind` ("" or "::": IPv6, dual-stack, where the
    kernel has IPv6; "0.0.0.0" or an IPv4 address: IPv4)."""
    if bind in ("", "::"):
        return socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    if ":" in bind:
        return socket.AF_INET6
    if _ip(bind) is not None:
        return socket.AF_INET
    return socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)[0][0]


def sockaddr_host(bind: str, family: socket.AddressFamily) -> str:
    """The host to pass to bind() for `bind` in `family`."""
    if bind == "":
        return "::" if family == socket.AF_INET6 else "0.0.0.0"
    return normalize_host(bind)


def listen(bind: str, port: int = 0, *, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on `bind` ("" = all interfaces, dual-stack where possible) and `port`."""
    family = family_of(bind)
    host = sockaddr_host(bind, family)
    dual = family == socket.AF_INET6 and host == "::"
    return socket.create_server((host, port), family=family, backlog=backlog, dualstack_ipv6=dual)


def grpc_bind(bind: str, port: int) -> str:
    """The address to give grpc's `add_insecure_port` ("[::]:P" binds every interface, both families)."""
    return format_address("::" if bind == "" else normalize_host(bind), port)


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" -> (host, port), the port in 1-65535; an IPv6 host may be in brackets ("[::1]:80"),
    which are removed (socket calls take the bare host). ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    digits = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not host or not digits:
        raise ValueError(f"{address!r} is not host:port")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: port {int(port)} is not in 1-65535")
    return host, int(port)
