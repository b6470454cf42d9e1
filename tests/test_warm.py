"""common.warm: `python -m MODULE ARGV` answered by a child forked from a process that imported MODULE once -- the
same status, stdout and stderr as the command run on its own; each run from the state right after the import; runs
side by side; a warm process that dies or stays idle is replaced at the next run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.warm import LOST, Warm

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = '''import os, signal, sys, time

IMPORTS = os.path.join(os.path.dirname(__file__), "imports.log")
with open(IMPORTS, "a") as log:  # one line per import of this module
    log.write(f"{os.getpid()}\\n")
calls = 0
warmed = False


def warm():  # common.warm calls it once, after the import: what the runs need imported
    global warmed
    import json  # noqa: F401
    warmed = True


def main(argv):
    global calls
    calls += 1
    print("out", os.getpid(), calls, *argv, flush=True)
    print("err", *argv, file=sys.stderr)
    kind = argv[0] if argv else ""
    if kind == "status":
        return int(argv[1])
    if kind == "raise":
        raise ValueError("broken on purpose")
    if kind == "exit":
        sys.exit("exit with a message")
    if kind == "sleep":
        time.sleep(float(argv[1]))
    if kind == "meet":  # wait (up to 60 s) until all N runs have started: they overlap, or this fails
        folder, count = argv[1], int(argv[2])
        open(os.path.join(folder, argv[3]), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(folder)) < count:
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.05)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stdin":
        print(repr(sys.stdin.read()))
    if kind == "warmed":
        print("warmed" if warmed else "cold")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture
def program(tmp_path):
    (tmp_path / "warmed.py").write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    warm = Warm("warmed", env=env)
    yield warm, tmp_path, env
    warm.stop()


def _alone(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmed", *argv], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=60)


@pytest.mark.parametrize("argv", [["a", "b"], ["status", "3"], ["raise"], ["exit"], ["kill"], ["stdin"]])
def test_a_run_answers_as_the_command_run_alone_when_warm(program, argv):
    warm, _, env = program
    forked, alone = warm.run(argv), _alone(env, *argv)
    assert forked.returncode == alone.returncode
    strip = lambda text: " ".join(word for word in text.split() if not word.isdigit())  # noqa: E731 (pids)
    assert strip(forked.stdout) == strip(alone.stdout)
    assert forked.stderr.splitlines()[:1] == alone.stderr.splitlines()[:1]
    assert forked.stderr.splitlines()[-1:] == alone.stderr.splitlines()[-1:]  # the exception or the message


def test_the_module_is_imported_once_and_each_run_starts_from_that_import_when_run_again(program):
    warm, folder, _ = program
    answers = [warm.run(["x"]).stdout.split() for _ in range(3)]
    assert [words[2] for words in answers] == ["1", "1", "1"]  # `calls` as after the import, every time
    assert len({words[1] for words in answers}) == 3  # a process of its own each
    assert len((folder / "imports.log").read_text().split()) == 1


def test_a_run_starts_after_the_modules_warm_hook_when_it_has_one(program):
    warm, _, env = program
    assert warm.run(["warmed"]).stdout.split()[-1] == "warmed"
    assert _alone(env, "warmed").stdout.split()[-1] == "cold"  # run alone: main() only, as `python -m`


def test_build_repos_warm_hook_imports_torch_which_its_command_line_does_not():
    """builder.cli imports torch only once its arguments are read (--help: 0.4 s); its warm() imports what a build
    needs, so that the TorchServe front's builds (forked warm) do not import it again each time (~3.5 s of CPU)."""
    code = ("import sys; import builder.cli as cli; assert 'torch' not in sys.modules; cli.warm(); "
            "assert {'torch', 'torchvision', 'builder.repository', 'builder.handler_model'} <= set(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_runs_overlap_and_keep_their_own_output_when_sent_together(program):
    warm, folder, _ = program
    (folder / "met").mkdir()
    with ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda i: warm.run(["meet", str(folder / "met"), "3", str(i)]), range(3)))
    assert [run.returncode for run in done] == [0, 0, 0]  # each saw the three started: side by side
    assert [run.stdout.split()[-1] for run in done] == ["0", "1", "2"]
    assert [run.stderr.split()[-1] for run in done] == ["0", "1", "2"]


def test_a_run_whose_warm_process_dies_gets_lost_and_the_next_run_starts_another_when_killed(program):
    warm, folder, _ = program
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(warm.run, ["sleep", "30"])
        time.sleep(3)
        first = warm._process
        first.kill()
        lost = running.result(timeout=60)
    assert lost.returncode == LOST
    again = warm.run(["again"])
    assert again.returncode == 0 and "again" in again.stdout
    assert warm._process is not first and len((folder / "imports.log").read_text().split()) == 2


def test_an_idle_warm_process_ends_and_a_later_run_starts_another_when_idle(tmp_path):
    (tmp_path / "warmed.py").write_text(PROGRAM)
    warm = Warm("warmed", idle_s=0.5, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    try:
        warm.run(["one"])
        first = warm._process
        first.wait(timeout=30)  # ended by itself once idle
        assert warm.run(["two"]).returncode == 0
        assert len((tmp_path / "imports.log").read_text().split()) == 2
    finally:
        warm.stop()


def test_a_child_gets_sigterm_when_its_warm_process_is_killed(program):
    warm, folder, _ = program
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(warm.run, ["sleep", "60"])
        time.sleep(3)
        children = subprocess.run(["pgrep", "-P", str(warm._process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        os.kill(warm._process.pid, signal.SIGKILL)
        assert running.result(timeout=60).returncode == LOST
    assert _ended(int(children[0]))  # no run left going on its own


def _ended(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # ended, not yet reaped
        except (OSError, IndexError):
            return True
        time.sleep(0.1)
    return False
