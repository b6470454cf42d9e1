"""The staging folder a build writes into, beside the repository, and the atomic swap into place."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from common.procs import pid_alive


class BuildError(RuntimeError):
    """The build cannot go on; the message is one line for the user."""


def check_writable(output: Path) -> None:
    """Make `output` and prove a staging folder can be made beside it, before the slow part."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        # A name no stale-staging sweep or watcher mistakes for a build; removed even if interrupted.
        probe = Path(tempfile.mkdtemp(prefix=f".{output.resolve().name}-probe-", dir=output.resolve().parent))
        probe.rmdir()
    except OSError as exc:
        raise BuildError(f"cannot write the repository {output}: {exc.strerror or exc}") from None


def remove_stale_staging(output: Path) -> list[Path]:
    """Staging folders of builds whose process is gone (killed -9, aborted): nothing else removes them."""
    removed = []
    for folder in output.resolve().parent.glob(f".{output.resolve().name}-build-*"):
        pid = folder.name.rsplit("-build-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class InterruptedAfterSwap(KeyboardInterrupt):
    """A signal held over the swap, raised once it is done: the build ends interrupted (exit 130), with
    every new model in place."""


@contextlib.contextmanager
def signals_deferred(interrupt: type[BaseException] = KeyboardInterrupt):
    """Hold SIGINT/SIGTERM until the block ends, then raise `interrupt`. An exception raised inside a native
    exporter's callback (ONNX) aborts the process (exit 134), skipping every cleanup; raised right after the
    block, it ends the build through its cleanup. A swap or a cleanup cut short leaves a half-swapped
    repository or a staging folder. (Masking the signal is not enough: any of the exporter's threads may
    take it.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread has handlers
        yield
        return
    caught = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in previous:  # inside the try: a signal landing between the two still has the first put back
            signal.signal(sig, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise interrupt


def staging_prefix(output: Path) -> str:
    return f".{output.resolve().name}-build-{os.getpid()}-"


def swap_in(built: Path, target: Path) -> Path:
    if target.exists():
        retired = built.with_name(built.name + ".old")
        target.rename(retired)  # kept until the new one is in place, so a failure loses nothing
        built.rename(target)
    else:
        built.rename(target)
    return target
