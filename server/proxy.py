"""The reverse proxy in front of Triton (HAProxy with proxy/haproxy.cfg), as one child process that dies with us.

Triton 2.51 has no TLS, no authentication and aborts on a ~100-byte JSON request with a huge declared shape;
its ports stay on 127.0.0.1 and the proxy listens publicly, holds requests while Triton restarts, and refuses
what Triton must not see (proxy/guard.lua)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from common.procs import port_free
from server.errors import ServerError
from server.procfs import with_parent_death

PROXY_DIR = Path(__file__).resolve().parent.parent / "proxy"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ProxySettings:
    """What serve-repo's flags set; the rest of the proxy's behaviour is proxy/haproxy.cfg's."""
    host: str
    http_port: int
    grpc_port: int
    max_body_bytes: int = 8 << 20
    rate_per_10s: int = 50_000
    retries: int = 15
    # Overload: inference requests at Triton at once (per port), and how long the rest may expect to wait in the
    # proxy's queue before they are refused at once (503, rule overload); none waits there over 2x that.
    max_in_flight: int = 32
    queue_ms: int = 500
    # Connections: all of them, and one client address's. An idle keep-alive connection costs ~2 KB; one sending
    # a body pins a 1 MB buffer for at most `timeout http-request` (10 s) (perf/results/proxy-memory.json). Clients
    # keep pools of connections (the traffic drill: a few hundred from one address, held while Triton restarts): 64
    # refused them. 16 addresses at their caps fill the proxy (it was 2 with 2,000 / 1,000).
    max_connections: int = 4096
    connections_per_client: int = 256
    # Address ranges of a front proxy (an ingress), space-separated: its requests are counted per client by the last
    # X-Forwarded-For address, and its connections are not capped per client.
    trusted: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token_file: Path | None = None


def haproxy_binary() -> str:
    """HAProxy from the system (Debian's package; `make setup` installs it): sbin is often not on PATH."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if not found:
        raise ServerError("haproxy not found: `make setup` installs it (tools/install_proxy.sh), "
                          "or serve with --proxy off on a trusted network")
    return found


class Proxy:
    """HAProxy forwarding settings.host's ports to a TritonServer's private ones."""

    def __init__(self, settings: ProxySettings, triton_http: str, triton_grpc: str, triton_metrics: str,
                 workdir: Path, log_file: Path | None = None):
        self.settings = settings
        self.upstream = {"TRITON_HTTP": triton_http, "TRITON_GRPC": triton_grpc, "TRITON_METRICS": triton_metrics}
        self.workdir = workdir
        # Begun afresh by the first start, appended to by restarts; serve-repo puts it outside its workdir.
        self.log_file = Path(log_file) if log_file else workdir / "haproxy.log"
        self._log_mode = "wb"
        self._process: subprocess.Popen | None = None
        self.returncode: int | None = None

    @property
    def http_url(self) -> str:
        return _bind(self.settings.host, self.settings.http_port)

    @property
    def grpc_url(self) -> str:
        return _bind(self.settings.host, self.settings.grpc_port)

    def environment(self) -> dict[str, str]:
        s = self.settings
        env = {"PROXY_DIR": str(PROXY_DIR), "PROXY_HTTP_BIND": _bind(s.host, s.http_port),
               "PROXY_GRPC_BIND": _bind(s.host, s.grpc_port), "PROXY_MAX_BODY": str(s.max_body_bytes),
               "PROXY_RATE_10S": str(s.rate_per_10s), "PROXY_RETRIES": str(s.retries),
               "PROXY_MAX_IN_FLIGHT": str(s.max_in_flight), "PROXY_QUEUE_MS": str(s.queue_ms),
               "PROXY_QUEUE_TIMEOUT": f"{2 * s.queue_ms}ms", "PROXY_MAXCONN": str(s.max_connections),
               "PROXY_CONN_PER_CLIENT": str(s.connections_per_client), **self.upstream}
        if s.tls_cert is not None:
            env["PROXY_TLS_PEM"] = str(self._pem())
        if s.trusted:
            env["PROXY_TRUSTED"] = s.trusted
        if s.token_file is not None:
            env["PROXY_TOKEN_FILE"] = str(Path(s.token_file).resolve())
        return env

    def _pem(self) -> Path:
        """HAProxy reads the certificate and its key from one file: ours, readable by us alone."""
        pem = self.workdir / "proxy.pem"
        key = self.settings.tls_key or self.settings.tls_cert
        text = Path(self.settings.tls_cert).read_text()
        if key != self.settings.tls_cert:
            text = text.rstrip("\n") + "\n" + Path(key).read_text()
        fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return pem

    def command(self) -> list[str]:
        # -db: in the foreground, no daemon, so that it is our child and dies with us.
        return [haproxy_binary(), "-db", "-f", str(PROXY_DIR / "haproxy.cfg")]

    def check(self) -> None:
        """HAProxy's own check of the configuration with these settings (a bad certificate, a short token)."""
        result = subprocess.run([*self.command(), "-c", "-q"], env={**os.environ, **self.environment()},
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise ServerError(f"the proxy refuses its configuration: {_last_lines(result.stdout + result.stderr)}")

    def start(self, timeout: float = 15) -> "Proxy":
        """Start HAProxy and wait until both public ports take connections."""
        self.check()
        for name, port in (("http", self.settings.http_port), ("grpc", self.settings.grpc_port)):
            if not port_free(self.settings.host, port):  # else another program's listener looks like ours
                raise ServerError(busy(name, port, self.settings.host))
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, self._log_mode) as log:  # a file, not a pipe: a log nobody reads never blocks it
            self._log_mode = "ab"
            self._process = subprocess.Popen(with_parent_death(self.command(), os.getpid()), stdout=log,
                                             stderr=subprocess.STDOUT, env={**os.environ, **self.environment()},
                                             start_new_session=True)
        self.returncode = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._reap()
                raise ServerError(f"the proxy exited with status {self.returncode}: {self.last_words()}")
            if all(_listening(self.settings.host, port) for port in (self.settings.http_port, self.settings.grpc_port)):
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerError(f"the proxy was not listening after {timeout:.0f}s: {self.last_words()}")

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def last_words(self) -> str:
        try:
            return _last_lines(self.log_file.read_text(errors="replace"))
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGUSR1: HAProxy stops listening and ends once the requests it holds are answered (soft stop)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGUSR1)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._reap()
        (self.workdir / "proxy.pem").unlink(missing_ok=True)  # our copy of the private key

    def _reap(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        self.returncode = process.returncode


def busy(api: str, port: int, host: str) -> str:
    return f"{api} port {port} on {host} is busy; choose another with --{api}-port"


def exposed(host: str) -> bool:
    """True where `host` reaches beyond this machine."""
    return host not in LOOPBACK and not host.startswith("127.")


def _bind(host: str, port: int) -> str:
    """host:port, an IPv6 address in brackets ([::1]:8000), as HAProxy and clients read it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listening(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        socket.create_connection((target, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _last_lines(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "(nothing logged)"
