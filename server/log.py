"""tritonserver's log: kept in a file and a tail, read back as the reason for a failure."""
from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

# Triton logs: failed to load 'resnet18' version 1: Internal: KeyError: ...\n\nAt: ...
_LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version \d+: (.*)")
# What a CPU-only machine always logs; never the reason for a failure.
_HARMLESS = ("CudaDriverHelper", "NVML", "DCGM", "CUDA driver version is insufficient")
# Its answer to an argument it cannot parse: "Usage: tritonserver [options]", sections ("Model Repository:") of
# options ("  --http-port <integer>", their descriptions indented), with why before or after
_USAGE = "Usage: tritonserver"
_OPTION = re.compile(r"  --[\w-]+( <[^>]*>)?$")
_SECTION = re.compile(r"[A-Z][\w /]*:$")
# How a process says it crashed (C++ exceptions, fatal signals, the kernel's OOM answer): these come first.
_CRASH = re.compile(r"terminate called|what\(\)|std::bad_alloc|Signal \(\d+\) received|Segmentation fault|"
                    r"Aborted|core dumped|out of memory", re.IGNORECASE)


class TritonLog:
    """The last lines tritonserver wrote (all of them go to `path`)."""

    def __init__(self, path: Path | None = None, keep: int = 1000):  # more than its usage's 404 lines
        self.path = path
        self._tail: collections.deque[str] = collections.deque(maxlen=keep)
        self.write_error: str | None = None  # why the file stopped being written, if it did

    def clear(self) -> None:
        self._tail.clear()

    def pump(self, process: subprocess.Popen) -> None:
        """Copy the process's output into the file and the tail until it ends (run in a thread). Whatever
        happens to the file (disk full, folder removed), the pipe is drained to the end: tritonserver blocks
        on its next log line once the pipe is full, alive and never restarted. A write that fails is said
        once, in the tail; the tail goes on."""
        log = self._open()
        try:
            for raw in process.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                self._tail.append(line)
                if log is None:
                    continue
                try:
                    log.write(line + "\n")
                    log.flush()
                except (OSError, ValueError) as exc:
                    self._failed(exc)
                    log = self._close(log)
        finally:
            self._close(log)

    def _open(self):
        try:
            return open(self.path, "a", encoding="utf-8", errors="replace")
        except (OSError, TypeError) as exc:  # TypeError: no path
            self._failed(exc)
            return None

    def _close(self, log) -> None:
        if log is not None:
            try:
                log.close()
            except OSError:
                pass
        return None

    def _failed(self, exc: BaseException) -> None:
        self.write_error = f"{type(exc).__name__}: {exc}"
        said = (f"serve-repo: cannot write tritonserver's log {self.path} ({self.write_error}); "
                f"its last {self._tail.maxlen} lines are kept in memory only")
        self._tail.append(said)
        # Also on our stderr: the line in the tail scrolls out of it, and the file is what a user reads.
        print(said, file=sys.stderr, flush=True)

    def crash_lines(self) -> str:
        """A crash's last words (deduplicated), or the empty string."""
        crash = [line.strip() for line in self._tail if _CRASH.search(line)]
        return " | ".join(dict.fromkeys(crash[-4:]))

    def reason(self, command: list[str] | None = None) -> str:
        """Triton's own words for a failure: a crash's last words, why each model failed to load, why it refused
        its arguments (and its `command`, the admin key masked), or its error lines."""
        crash = self.crash_lines()
        if crash:
            return crash
        lines = list(self._tail)
        options = [line for line in lines if _OPTION.match(line)]
        if len(options) >= 20:
            # an argument refused: tritonserver prints its usage (400 lines, some naming "error"), and why: before
            # it (getopt's words) or after it (a value it cannot read)
            said = [line.strip() for line in lines if line.strip() and not line[0].isspace()
                    and not line.startswith(_USAGE) and not _SECTION.match(line)]
            shown = " ".join(re.sub(r"(triton-admin-key=)\S+", r"\1...", arg) for arg in command or ())
            return (f"it refused its arguments: {' | '.join(said[-3:]) or 'no reason given'}"
                    + (f" (its command: {shown})" if shown else ""))
        failed = [m.group(1) + ": " + m.group(2).split("\\n")[0].strip()
                  for m in map(_LOAD_FAILURE.search, lines) if m]
        if failed:
            return "; ".join(dict.fromkeys(failed))
        errors = [line for line in lines if (line.startswith("E") or "error" in line.lower())
                  and not any(noise in line for noise in _HARMLESS)]
        return " | ".join(errors[-4:] or lines[-5:]) or "no output"

    def last_words(self) -> str:
        """What a server that died said last: its crash lines, else its last log line."""
        crash = self.crash_lines()
        if crash:
            return crash
        said = [line.strip() for line in self._tail if line.strip()]
        return "nothing in its log says why (last line: " + (said[-1][:200] if said else "none") + ")"
