"""serve-repo's own plumbing: the log pipe never blocks tritonserver, a dead run's log outlives the next start,
tritonserver dies with serve-repo without a preexec_fn."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from perf.serve import ServeRepo
from server import triton
from server.log import TritonLog
from server.procfs import KEPT_LOG_FOLDER, remove_stale, with_parent_death

TALKER = "import sys\nfor i in range(200000): print('line', i)\n"  # ~2.5 MB: far more than a pipe holds


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_log_pump_drains_the_pipe_to_the_end_when_the_log_file_cannot_be_written(capsys):
    process = subprocess.Popen([sys.executable, "-c", TALKER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = TritonLog(Path("/dev/full"))  # every write fails: ENOSPC, as on a full disk
    pump = threading.Thread(target=log.pump, args=(process,), daemon=True)
    pump.start()
    assert process.wait(timeout=60) == 0, "the talker blocked on a full pipe"
    pump.join(30)
    assert not pump.is_alive()
    assert log.write_error and "No space left" in log.write_error
    tail = list(log._tail)
    assert tail[-1] == "line 199999"  # the tail went on to the end
    assert capsys.readouterr().err.count("cannot write tritonserver's log /dev/full") == 1  # said once


def test_dead_runs_log_is_kept_and_bounded_when_the_next_start_cleans_up(tmp_path):
    for index in range(12):
        folder = tmp_path / f"triton-serve-{_dead_pid()}-x{index}"
        folder.mkdir()
        (folder / "tritonserver.log").write_text(f"run {index}: Signal (6) received\n")
        os.utime(folder / "tritonserver.log", (index, index))
        removed = remove_stale(tmp_path, shm=tmp_path / "no-shm")
        assert not folder.exists()
        kept = [entry[len("kept log "):] for entry in removed if entry.startswith("kept log ")]
        assert kept and Path(kept[0]).read_text() == f"run {index}: Signal (6) received\n"
        ended = time.strftime("%Y%m%dT%H%M%S", time.localtime(index))  # when its last line was written
        assert Path(kept[0]).name == f"{folder.name}-{ended}.log"  # and the dead pid, in the folder's name
    logs = sorted((tmp_path / KEPT_LOG_FOLDER).glob("*.log"))
    assert len(logs) == 10  # bounded: the newest ten
    assert remove_stale(tmp_path, shm=tmp_path / "no-shm") == []  # the kept logs are not a dead run's folder


def test_started_command_dies_with_its_parent_and_keeps_its_pid_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        "from server.procfs import with_parent_death\n"
        "child = subprocess.Popen(with_parent_death(['/bin/sleep', '300'], os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/sleep"):
        time.sleep(0.05)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/sleep"), "not exec'd in place"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and \
            "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_tritonserver_is_started_without_a_preexec_fn_when_serve_repo_starts_it(tmp_path, monkeypatch):
    """preexec_fn runs between fork and exec in a copy of a threaded process (deadlock-prone): the parent-death
    signal is set by the exec wrapper instead, which execs tritonserver in place."""
    popen, seen = subprocess.Popen, {}

    class NotStarted(Exception):
        pass

    def record(args, **kwargs):
        if not any(str(arg).endswith("/tritonserver") for arg in args):
            return popen(args, **kwargs)
        seen.update(kwargs, args=list(args))
        raise NotStarted

    monkeypatch.setattr(triton.subprocess, "Popen", record)
    (tmp_path / "repo").mkdir()
    server = triton.TritonServer.local(tmp_path / "repo")
    try:
        with pytest.raises(NotStarted):
            server.start(timeout=5)
        command = server.command()
    finally:
        server.stop()
    assert seen.get("preexec_fn") is None
    assert seen["start_new_session"] is True
    assert seen["args"] == with_parent_death(command, os.getpid())
    assert seen["args"][:2] == [sys.executable, "-c"] and seen["args"][4:] == command


def test_serve_repo_keeps_the_log_it_names_when_it_gives_up_after_tritonserver_exited_0(tmp_path):
    """A tritonserver SIGTERMed by someone else drains and exits 0, like one serve-repo stopped; serve-repo's
    own stop used to remove the log its error message names."""
    (tmp_path / "repo").mkdir()  # an empty repository: tritonserver is ready in about a second
    serve = ServeRepo(tmp_path / "repo", "--max-restarts", "0", timeout=120)
    try:
        os.kill(serve.triton_pid, signal.SIGTERM)
        assert serve.process.wait(60) == 1
        line = serve.wait_for("died again; log", 10)
    finally:
        serve.stop()
    assert "exit status 0" in line and "; log " in line
    log = Path(line.rsplit("; log ", 1)[1])
    assert log.is_file() and "Signal (15) received" in log.read_text()
    shutil.rmtree(log.parent)


def test_a_start_whose_arguments_tritonserver_refuses_names_its_reason_and_command(tmp_path):
    """tritonserver answers an argument it cannot parse with its 400-line usage (lines naming "error" among them),
    then why: serve-repo's error is that last line and the command, not the usage's lines."""
    from server.errors import ServerError

    (tmp_path / "repo").mkdir()
    server = triton.TritonServer.local(tmp_path / "repo", extra_args=["--http-thread-count=many"])
    with pytest.raises(ServerError) as refused:
        server.start(timeout=60)
    said = str(refused.value)
    assert said.startswith("tritonserver exited with status 1: it refused its arguments: "), said
    assert "Invalid option value. Got many (its command: " in said and " --http-thread-count=many)" in said, said
    assert "error-level" not in said and "Management:" not in said, said
    assert server.admin_key and server.admin_key not in said and "triton-admin-key=..." in said, said


def test_a_start_with_an_option_tritonserver_does_not_know_names_getopts_words(tmp_path):
    from server.errors import ServerError

    (tmp_path / "repo").mkdir()
    server = triton.TritonServer.local(tmp_path / "repo", extra_args=["--no-such-option"])
    with pytest.raises(ServerError) as refused:
        server.start(timeout=60)
    assert "it refused its arguments: " in str(refused.value), refused.value
    assert "unrecognized option '--no-such-option'" in str(refused.value), refused.value
