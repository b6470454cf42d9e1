"""Process and port helpers shared by the server, the builder and the drills."""
from __future__ import annotations

import socket

import psutil


def pid_alive(pid: int) -> bool:
    """True if a process with this id exists (someone else's live process counts; so does a zombie)."""
    return psutil.pid_exists(pid)


def family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (`::1`, `::`), else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_free(host: str, port: int) -> bool:
    """True if `port` on `host` (IPv4 or IPv6) can be bound now."""
    with socket.socket(family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (another process may still take it before we bind)."""
    with socket.socket(family(host)) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
