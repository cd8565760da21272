"""TLS for a job's control plane: the coordinator's gRPC service and the replicas' catch-up HTTPS.

One set of PEM files serves every process of a job: `cert` and `key` are what a process's servers
present (the coordinator's gRPC port, a replica host's catch-up server), `ca` what it checks the
servers it dials against (the coordinator, a peer's catch-up server). The certificate must name
the address that is dialed (a subjectAltName IP or DNS entry), or `server_name` gives the name to
check instead. Servers do not ask for client certificates: a client proves itself with the job
token, as without TLS. FTAR is not encrypted (docs/design/index.md, "TLS").
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass

FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


@dataclass(frozen=True)
class TLS:
    cert: str  # PEM files (paths)
    key: str
    ca: str
    server_name: str | None = None  # the name the servers' certificates are checked against, if not the address

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, server_name: str | None = None):
        """The TLS that `--tls-cert/--tls-key/--tls-ca [--tls-server-name]` ask for, None without them.
        ValueError naming the flag: one given without the others, a file that cannot be read or is not PEM."""
        given = dict(zip(FLAGS, (cert, key, ca)))
        if not any(given.values()):
            if server_name:
                raise ValueError("--tls-server-name: needs --tls-cert, --tls-key and --tls-ca")
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"{', '.join(missing)}: TLS needs {', '.join(FLAGS)} together")
        tls = cls(str(cert), str(key), str(ca), server_name or None)
        tls.server_context()  # every file read and checked now, not at the first connection
        tls.client_context()
        return tls

    def flags(self) -> list[str]:
        """The flags that give a child process this TLS (what `from_flags` reads; absolute paths: a
        child may start in another directory)."""
        cert, key, ca = (os.path.abspath(p) for p in (self.cert, self.key, self.ca))
        out = [FLAGS[0], cert, FLAGS[1], key, FLAGS[2], ca]
        return out + (["--tls-server-name", self.server_name] if self.server_name else [])

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) as bytes (what gRPC's SSL credentials take)."""
        return tuple(_read(flag, path) for flag, path in zip(FLAGS, (self.cert, self.key, self.ca)))  # type: ignore[return-value]

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            why = f"not a certificate and its key: {e}"
            raise ValueError(f"--tls-cert {self.cert} / --tls-key {self.key}: {why}") from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Checks a server's certificate against `ca`, and its name (the address dialed, or `server_name`)."""
        try:
            return ssl.create_default_context(cafile=self.ca)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--tls-ca {self.ca}: not a CA certificate: {e}") from None

    def wrap_client(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        return self.client_context().wrap_socket(sock, server_hostname=self.server_name or host)


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None


def speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether the server at host:port answers a TLS handshake (its certificate unchecked: this only
    tells a TLS server from a plain one, to say why a plain client is refused)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s, ctx.wrap_socket(s):
            return True
    except (OSError, ValueError):
        return False


def add_tls_arguments(p) -> None:
    """`--tls-cert/--tls-key/--tls-ca/--tls-server-name` on an argparse parser (read by `tls_of`)."""
    p.add_argument("--tls-cert", default=None, help="TLS: PEM certificate this process's servers present")
    p.add_argument("--tls-key", default=None, help="TLS: PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca",
        default=None,
        help="TLS: PEM CA that the servers dialed (coordinator, catch-up) must be signed by; the three "
        "flags together turn TLS on for the coordinator's gRPC and catch-up (FTAR stays plain)",
    )
    p.add_argument(
        "--tls-server-name", default=None, help="TLS: the name servers' certificates must carry, if not the address"
    )


def tls_of(args) -> TLS | None:
    """The TLS of parsed `add_tls_arguments` flags; ValueError naming the flag at fault."""
    flags = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")  # (a parser without them: no TLS)
    return TLS.from_flags(*(getattr(args, name, None) for name in flags))
