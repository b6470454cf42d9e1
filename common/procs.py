"""Process and port helpers shared by the server, the builder, perf and the drills."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True if a process with this id exists (someone else's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_free(host: str, port: int) -> bool:
    """True if `port` on `host` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (another process may still take it before we bind)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_bounded(cmd: list[str], log: Path, timeout: float, grace: float = 20, **popen) -> int | None:
    """Run `cmd` in a session of its own, its stdout and stderr appended to `log`; past `timeout` seconds
    SIGTERM its process group, `grace` seconds later SIGKILL it. The exit status, or None if it ran out
    of time. Only that group is signalled, while its leader is unreaped (its pid cannot have been reused)."""
    with open(log, "ab") as sink:
        process = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, **popen)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(process.pid, signal.SIGTERM)  # lets the child stop its servers and write what it has
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not _exited(process.pid):
            time.sleep(0.2)
        _signal_group(process.pid, signal.SIGKILL)  # whatever is left in the group (a stuck grandchild)
        process.wait()
        return None


def _exited(pid: int) -> bool:
    """True once `pid` (our child) has exited, without reaping it: a zombie keeps its pid and group ours."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
