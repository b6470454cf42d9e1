"""A command run in a process forked from one that has already imported it: `python -m MODULE ARGV...` without the
import each time (build-repo spends ~85 % of a small build importing torch and torchvision).

`Warm(MODULE).run(argv)` answers as `subprocess.run([python, "-m", MODULE, *argv], capture_output=True, text=True)`
would -- the exit status (negative: the signal that ended it), stdout and stderr -- from a child forked by a warm
process (`python -m common.warm MODULE`: imports MODULE once, and calls `MODULE.warm()` where it has one -- what its
runs import lazily -- then forks one child per run, which calls `MODULE.main(argv)` with its own stdin, stdout and
stderr; the warm process itself computes nothing: no thread pool of torch's has run when a child is forked). Each run
starts from the warm process's state as it was after the import, never from an earlier run's; runs may overlap. The warm process is started at the first run and
stopped after `idle_s` without one (it holds the imported modules' memory: ~700 MB for build-repo); if it dies, the
runs in flight get status -9 and the next run starts another. The warm process ends when its parent closes the pipe
to it (or dies) and its children have ended; a child gets SIGTERM (build-repo's clean interruption) if the warm
process dies before it."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
LOST = -signal.SIGKILL  # a run whose warm process died before the run ended


def _child(module, request: dict, parent: int) -> None:
    """In the forked child: the run's own files, then MODULE.main(argv); never returns. (PR_SET_PDEATHSIG follows
    the thread that forked: the warm process has one thread.)"""
    code = 1
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
            os._exit(1)  # the warm process died before the call: no signal would come
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        argv = [str(arg) for arg in request["argv"]]
        sys.argv = [module.__name__, *argv]
        try:
            returned = module.main(argv)
        except SystemExit as exc:
            returned = exc.code
        if returned is None or isinstance(returned, int):
            code = returned or 0
        else:  # sys.exit("message"), as the interpreter does
            print(returned, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def serve(name: str) -> int:
    """The warm process: import `name`, say so on stdout, then one child per request line on stdin (JSON: id, argv,
    stdout, stderr), one line on stdout per ended child (id, status); ends at stdin's end once its children have."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the parent's terminal reaches the children, not this
    module = importlib.import_module(name)
    if callable(getattr(module, "warm", None)):  # what its runs import beyond the module itself (build-repo: torch)
        module.warm()
    sys.stdout.flush()
    os.write(1, b'{"ready": true}\n')
    children: dict[int, int] = {}
    pending, reading = b"", True
    while reading or children:
        readable, _, _ = select.select([0] if reading else [], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            reading = bool(data)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                me = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _child(module, request, me)
                children[pid] = request["id"]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ended = {"id": children.pop(pid), "status": os.waitstatus_to_exitcode(status)}
            os.write(1, json.dumps(ended).encode() + b"\n")
    return 0


@dataclass
class _Run:
    process: subprocess.Popen  # the warm process it was sent to
    done: threading.Event = field(default_factory=threading.Event)
    status: int | None = None


class Warm:
    """`python -m MODULE` runs forked from a warm process (see the module's docstring); thread-safe."""

    def __init__(self, module: str, idle_s: float = 300, env: dict | None = None, python: str = sys.executable):
        self.module, self.idle_s, self.env, self.python = module, idle_s, env, python
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._waiting: dict[int, _Run] = {}
        self._next = 0
        self._idle: threading.Timer | None = None

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            out.touch(mode=0o600)
            err.touch(mode=0o600)
            with self._lock:
                if self._idle is not None:
                    self._idle.cancel()
                process = self._started()
                self._next += 1
                run_id = self._next
                run = self._waiting[run_id] = _Run(process)
                request = {"id": run_id, "argv": list(map(str, argv)), "stdout": str(out), "stderr": str(err)}
                try:
                    process.stdin.write(json.dumps(request) + "\n")
                    process.stdin.flush()
                except OSError:  # died meanwhile: the reader ends this run with LOST
                    pass
            run.done.wait()
            with self._lock:
                if not self._waiting and self._process is not None:
                    self._idle = threading.Timer(self.idle_s, self._stop_if_idle, args=(self._process,))
                    self._idle.daemon = True
                    self._idle.start()
            return subprocess.CompletedProcess([self.python, "-m", self.module, *argv], run.status,
                                               out.read_text(errors="replace"), err.read_text(errors="replace"))

    def _started(self) -> subprocess.Popen:
        """The warm process, started if there is none (under self._lock)."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        process = subprocess.Popen([self.python, "-m", "common.warm", self.module], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=self.env)
        self._process = process
        threading.Thread(target=self._read, args=(process,), daemon=True, name=f"warm {self.module}").start()
        return process

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            try:
                ended = json.loads(line)
            except ValueError:
                continue
            if "id" in ended:
                self._finish(ended["id"], int(ended["status"]))
        process.wait()
        with self._lock:  # died (or stopped idle): its runs in flight were lost with it
            lost = [run_id for run_id, run in self._waiting.items() if run.process is process]
            if self._process is process:
                self._process = None
        for run_id in lost:
            self._finish(run_id, LOST)

    def _finish(self, run_id: int, status: int) -> None:
        with self._lock:
            run = self._waiting.pop(run_id, None)
        if run is not None:
            run.status = status
            run.done.set()

    def _stop_if_idle(self, process: subprocess.Popen) -> None:
        with self._lock:
            if self._waiting or self._process is not process:
                return
            self._process = None
        try:
            process.stdin.close()  # it ends once its children have (none: idle)
        except OSError:
            pass

    def stop(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            try:
                process.stdin.close()
            except OSError:
                pass
            process.wait()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
