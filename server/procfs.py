"""tritonserver's processes as /proc shows them: its python-backend stubs, and what killed runs left behind."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from common.procs import pid_alive

# Our names in /tmp and /dev/shm carry the owning process id, so that a later start can tell
# what a killed serve-repo left behind (its pid is gone) from what a running one still uses.
WORKDIR_PREFIX = "triton-serve-"
SHM_PREFIX = "tcls"
_OWNED = re.compile(r"^(?:triton-serve-|tcls)(\d+)[-_]")
_STUB_OWNER = re.compile(r"/triton-serve-(\d+)-[^/]*/backends/")
_PR_SET_PDEATHSIG = 1
KEPT_LOG_FOLDER = "triton-serve-logs"  # no pid in the name: the stale sweep leaves it alone
KEPT_LOGS, KEPT_LOG_BYTES = 10, 8 << 20


def remove_stale(tmp: Path | None = None, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove what serve-repos that were killed left behind: stubs still running from their work directories
    (python_backend 24.10's stub can deadlock on its own exit when its tritonserver died with a batch in
    flight: its health thread waits for the GIL the main thread holds while it waits for the dead server),
    then the work directories and python-backend shared memory."""
    removed = []
    for pid, argv, _, _ in _processes("triton_python"):
        owner = argv and _STUB_OWNER.search(argv[0])  # <tmp>/triton-serve-<pid>-*/backends/python/triton_python_backend_stub
        if owner and not pid_alive(int(owner.group(1))):
            try:
                os.kill(pid, signal.SIGKILL)
                removed.append(f"stub {pid} {argv[8] if len(argv) > 8 else ''}".rstrip())
            except OSError:
                pass
    for folder, is_dir in ((Path(tmp or tempfile.gettempdir()), True), (shm, False)):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            owner = _OWNED.match(entry.name)
            if not owner or pid_alive(int(owner.group(1))):
                continue
            if is_dir and entry.is_dir():
                kept = keep_log(entry)
                if kept is not None:
                    removed.append(f"kept log {kept}")
            try:
                shutil.rmtree(entry) if is_dir and entry.is_dir() else entry.unlink()
                removed.append(str(entry))
            except OSError:
                pass
    return removed


def keep_log(workdir: Path, keep: int = KEPT_LOGS, limit: int = KEPT_LOG_BYTES) -> Path | None:
    """A dead run's tritonserver.log, moved to <tmp>/triton-serve-logs/ before its work folder is removed: the
    evidence of a crash outlives the next start. The newest `keep` are kept, each its last `limit` bytes."""
    log = workdir / "tritonserver.log"
    try:
        if not log.is_file() or log.stat().st_size == 0:
            return None
        folder = workdir.parent / KEPT_LOG_FOLDER
        folder.mkdir(exist_ok=True)
        ended = time.strftime("%Y%m%dT%H%M%S", time.localtime(log.stat().st_mtime))  # the run's last line
        target = folder / f"{workdir.name}-{ended}.log"  # triton-serve-<dead pid>-<random>-<time>.log
        with open(log, "rb") as source:
            source.seek(max(0, log.stat().st_size - limit))
            target.write_bytes(source.read())
        kept = folder.glob(f"{WORKDIR_PREFIX}*.log")  # not serve-repo's proxy logs (haproxy-<port>.log)
        for old in sorted(kept, key=lambda p: p.stat().st_mtime)[:-keep]:
            old.unlink(missing_ok=True)
        return target
    except OSError:
        return None


# tritonserver is started through this: it sets the parent-death signal in the new process, after exec, where
# no thread of ours exists (subprocess's preexec_fn runs between fork and exec in a copy of a threaded process,
# which CPython documents as deadlock-prone), checks its parent is still the one that started it, then execs
# tritonserver in place (the same pid).
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   f"if ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL):\n"
                   "    sys.exit('serve-repo: prctl(PR_SET_PDEATHSIG): ' + os.strerror(ctypes.get_errno()))\n"
                   "if os.getppid() != int(sys.argv[1]):\n"
                   "    os._exit(1)\n"
                   "os.execv(sys.argv[2], sys.argv[2:])\n")


def with_parent_death(command: list[str], parent: int) -> list[str]:
    """`command`, started so that the kernel kills it when `parent` ends, even by kill -9. The kernel's parent is
    the thread that calls Popen: start it from one that lives as long as the server (serve-repo's main thread)."""
    import sys

    return [sys.executable, "-c", DIE_WITH_PARENT, str(parent), *command]


class Stub:
    """A python-backend stub process, read from /proc: its model, instance and whether it is still alive."""

    def __init__(self, pid: int, argv: list[str], zombie: bool):
        self.pid, self.zombie = pid, zombie
        # triton_python_backend_stub <repo>/<model>/<version>/model.py <shm region> <sizes> <parent pid>
        #   <backend dir> <ipc size> <instance name> <runtime>   (python_backend r24.10, stub_launcher.cc)
        self.model = Path(argv[1]).parent.parent.name if len(argv) > 1 else "?"
        self.instance = argv[8] if len(argv) > 8 else str(pid)

    @property
    def alive(self) -> bool:
        return not self.zombie

    @property
    def serves(self) -> bool:
        """An instance's stub (`<model>_<group>_<n>`), not the short-lived one a load starts for the model
        itself (named after the model), which exits once the model is loaded."""
        return self.instance != self.model and self.instance.startswith(self.model + "_")


def stubs_of(pid: int) -> list[Stub]:
    """The python-backend stubs tritonserver `pid` started (zombies included: they died)."""
    return [Stub(child, argv, state == "Z") for child, argv, parent, state in _processes("triton_python")
            if parent == pid]


def running_stubs() -> set[int]:
    """The python-backend stubs running on this machine, whoever started them (zombies are not running)."""
    return {pid for pid, _, _, state in _processes("triton_python") if state != "Z"}


def _processes(comm: str) -> list[tuple[int, list[str], int, str]]:
    """(pid, argv, parent pid, state) of the processes whose name starts with `comm`, zombies included (no argv).
    One read of /proc/PID/stat per process, argv only for those named so: the supervisor looks 4 times a second,
    and psutil's process_iter cost 5x as much CPU (~5% of a core on an idle server)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # ended meanwhile
            continue
        # "PID (NAME) STATE PPID ...": NAME (the kernel's, a zombie's too) may hold spaces and parentheses
        name, rest = stat[stat.find(b"(") + 1:stat.rfind(b")")], stat[stat.rfind(b")") + 2:].split()
        if not name.decode("utf-8", "replace").startswith(comm) or len(rest) < 2:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                argv = [arg.decode("utf-8", "replace") for arg in cmdline.read().split(b"\0") if arg]
        except OSError:
            argv = []
        found.append((int(entry.name), argv, int(rest[1]), "Z" if rest[0] == b"Z" else "R"))
    return found
