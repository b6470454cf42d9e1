"""serve-repo survives its bad day: a dead stub's instances are replaced in place, a dead tritonserver restarted,
the request that aborts Triton 2.51 costs one restart, SIGTERM drains, kill -9 leaves nothing.

The drills are drills.faults' (which repeats them and keeps the figures in drills/results/); here each
runs once and its outcome is checked. Time limits are far above what was measured (~9 s to recover on
2 cores): they only catch "never"."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from drills import faults
from perf.serve import ServeRepo
from support import SMALL, reference_logits
from server.procfs import remove_stale


@pytest.fixture(scope="module")
def small_repo(repository, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("supervised") / "repo"
    repo.mkdir()
    for model in repository.glob(f"{SMALL}*"):
        shutil.copytree(model, repo / model.name)
    return repo


@pytest.fixture(scope="module")
def serve(small_repo):
    running = ServeRepo(small_repo)
    yield running
    running.stop()


def _case(small_model, seed):
    batch = faults.image(seed)
    return batch, reference_logits(small_model, batch)


def test_dead_stub_is_replaced_in_place_and_the_model_answers(serve, small_model):
    result = faults.kill_stub(serve, SMALL, *_case(small_model, 1))  # raises if it never answers correctly
    assert f"its stub {SMALL}_0_0 died" in result["log"] or "its stubs died" in result["log"]
    assert "replacing" not in result["done"] and "ready again" in result["done"]
    assert not serve.seen("replacing in place failed"), serve.lines[-10:]
    assert serve.http.is_model_ready(SMALL) and serve.http.is_model_ready(f"{SMALL}_image")
    print(result)


def test_renewed_changes_only_the_signature_of_the_dead_instances_group():
    from common.modelconfig import from_json, to_json
    from server.supervisor import renewed

    config = from_json({"name": "m", "max_batch_size": 8, "instance_group": [
        {"name": "m_0", "kind": "KIND_CPU", "count": 2},
        {"name": "m_1", "kind": "KIND_CPU", "count": 1, "rate_limiter": {"priority": 1}}]})
    once = renewed(config, "m_0_1")
    assert once.instance_group[0].rate_limiter.priority == 2  # the lowest no group has
    assert once.instance_group[1] == config.instance_group[1]  # the other group is left alone
    assert {k: v for k, v in to_json(once).items() if k != "instance_group"} == {"name": "m", "max_batch_size": 8}
    assert renewed(once, "m_0_0").instance_group[0].rate_limiter.priority == 3  # a new one each time
    assert renewed(renewed(once, "m_0_0"), "m_0_0").instance_group[0].rate_limiter.priority == 2
    assert renewed(config, "m_1_0").instance_group[1].rate_limiter.priority == 2
    everything = renewed(config, "all")
    assert [g.rate_limiter.priority for g in everything.instance_group] == [2, 3]
    assert not config.instance_group[0].HasField("rate_limiter")  # the caller's config is not changed
    assert to_json(once)["instance_group"][0] == {"name": "m_0", "kind": "KIND_CPU", "count": 2,
                                                  "rate_limiter": {"priority": 2}}  # as Triton's load API reads it


def test_dead_preprocess_stub_brings_the_image_path_back(serve):
    result = faults.kill_preprocess_stub(serve, SMALL)  # raises unless NAME_image answers as before
    assert f"{SMALL}_preprocess: its stub" in result["log"]
    print(result)


def test_killed_tritonserver_is_restarted_and_answers(serve, small_model):
    result = faults.kill_tritonserver(serve, SMALL, *_case(small_model, 2))
    assert "tritonserver died (killed by SIGKILL)" in result["log"]
    print(result)


def test_the_json_shape_request_that_aborts_triton_costs_one_restart(serve, small_model):
    """Triton 2.51 allocates shape x 4 bytes (60 GB) before it checks the data: std::bad_alloc, abort.
    serve-repo cannot stop that request reaching Triton; it brings the server back."""
    result = faults.crashing_request(serve, SMALL, *_case(small_model, 3))  # raises unless it answers right again
    if result["restarted"]:  # what 2.51 does here
        assert "std::bad_alloc" in result["log"]
    elif result["reply"]:  # a fixed Triton would answer with an error status instead
        assert result["reply"].startswith(("HTTP/1.1 4", "HTTP/1.1 5")), result
    # Seen twice on 2026-11-27 in whole-file runs under load: no reply and no "tritonserver died" line within 30 s,
    # the server answering right again after ~5 s (cause not established); what holds is that it answers again.
    print(result)


def test_sigterm_under_load_answers_what_triton_holds_and_stops_within_the_drain(small_repo, small_model):
    result = faults.sigterm_under_load(small_repo, SMALL, *_case(small_model, 4), drain=5)
    assert result["exit_status"] == 0 and "tritonserver stopped" in result["last_line"]
    assert result["answered"] >= result["queued_at_sigterm"], result
    assert result["worst_relative_error"] <= faults.TOLERANCE
    assert result["stopped_after_s"] < result["drain_s"] + 6, result  # the drain, then the kill's 5 s
    assert not result["tritonserver_left"] and not result["shm_left"]
    print(result)


def test_kill_9_of_serve_repo_takes_tritonserver_and_stubs_along_and_the_next_start_cleans_up(small_repo):
    result = faults.kill_9_serve_repo(small_repo)
    assert result["stubs"] >= 2
    assert result["tritonserver_gone_after_s"] is not None, "tritonserver outlived serve-repo's kill -9"
    assert None not in result["stubs_gone_after_s"], "a stub outlived serve-repo's kill -9"
    assert result["left_behind"]["workdirs"], "kill -9 leaves its work folder (for the next start to remove)"
    assert not result["still_there"]
    print(result)


def test_stale_cleanup_spares_what_live_processes_own(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir(), shm.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = os.getpid()
    for owner in (dead.pid, live):
        (tmp / f"triton-serve-{owner}-abc").mkdir()
        (shm / f"tcls{owner}_8000_region").write_bytes(b"x")
    (shm / "triton_python_backend_shm_region_other").write_bytes(b"x")  # not ours: never touched
    removed = remove_stale(tmp, shm)
    folders = sorted(Path(p).name for p in removed if not p.startswith("stub "))  # a real stale stub may go too
    assert folders == sorted([f"triton-serve-{dead.pid}-abc", f"tcls{dead.pid}_8000_region"])
    assert sorted(p.name for p in shm.iterdir()) == sorted([f"tcls{live}_8000_region",
                                                            "triton_python_backend_shm_region_other"])


def test_stale_cleanup_ends_stubs_a_killed_serve_repo_left_running(tmp_path):
    """A stub can hang on its own exit after its tritonserver died (python_backend 24.10); the next start ends
    those whose serve-repo is gone, and only those (here: `sleep` under a stub's name and path)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stubs = {}
    for owner in (dead.pid, os.getpid()):
        exe = tmp_path / f"triton-serve-{owner}-abc" / "backends" / "python" / "triton_python_backend_stub"
        exe.parent.mkdir(parents=True)
        shutil.copy(shutil.which("sleep"), exe)
        stubs[owner] = subprocess.Popen([str(exe), "120"])
    try:
        removed = remove_stale(tmp_path, tmp_path / "shm")
        assert stubs[dead.pid].wait(10) == -signal.SIGKILL
        assert f"stub {stubs[dead.pid].pid}" in removed, removed
        assert stubs[os.getpid()].poll() is None, "a stub of a live serve-repo was killed"
    finally:
        for stub in stubs.values():
            stub.kill()
            stub.wait()


def test_supervisor_leaves_deliberate_unloads_and_reloads_alone(small_repo):
    """In explicit mode a user (or perf.tune) unloads and reloads models; those stubs end on purpose."""
    import json
    import time

    serve = ServeRepo(small_repo, "--model-control", "explicit")
    try:
        mark = len(serve.lines)
        config = serve.http.get_model_config(SMALL)
        config["dynamic_batching"]["max_queue_delay_microseconds"] = 1234  # a real reload, new stubs
        serve.http.load_model(SMALL, config=json.dumps(config))
        assert serve.http.is_model_ready(SMALL)
        serve.http.unload_model(f"{SMALL}_image")
        serve.http.unload_model(f"{SMALL}_preprocess")
        deadline = time.monotonic() + 30
        while serve.http.is_model_ready(f"{SMALL}_preprocess") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # a dozen supervisor polls
        assert not serve.seen("died", mark), serve.lines[mark:]
        assert not serve.http.is_model_ready(f"{SMALL}_preprocess")
        assert serve.http.get_model_config(SMALL)["dynamic_batching"]["max_queue_delay_microseconds"] == 1234
    finally:
        serve.stop()


# A python model whose unload never finishes by itself: its finalize() outlasts any test.
_SLOW_UNLOAD = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(1, np.float32))]) for _ in requests]

    def finalize(self):
        time.sleep(300)
'''
_SLOW_CONFIG = '''name: "slow"
backend: "python"
input { name: "IN" data_type: TYPE_FP32 dims: [1] }
output { name: "OUT" data_type: TYPE_FP32 dims: [1] }
instance_group { kind: KIND_CPU count: 1 }
'''


def test_supervisor_reload_gives_up_at_once_when_stopped_while_the_unload_hangs(tmp_path, start_server):
    """A stop while the supervisor's fallback (unload + load) waits for the unload ends the wait, loads nothing."""
    import threading
    import time

    from server.supervisor import Supervisor

    (tmp_path / "repo" / "slow" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "slow" / "1" / "model.py").write_text(_SLOW_UNLOAD)
    (tmp_path / "repo" / "slow" / "config.pbtxt").write_text(_SLOW_CONFIG)
    server = start_server(tmp_path / "repo", drain_seconds=1)
    lines, stop = [], threading.Event()
    supervisor = Supervisor(server, log=lines.append)
    supervisor._stop = stop
    reload = threading.Thread(target=supervisor.reload_whole, args=("slow", time.monotonic()))
    reload.start()
    deadline = time.monotonic() + 60
    while supervisor._state("slow") != "UNLOADING" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor._state("slow") == "UNLOADING"  # finalize() holds the unload
    stopped = time.monotonic()
    stop.set()
    reload.join(60)
    assert not reload.is_alive()
    assert lines[-1] == "serve-repo: slow: reload failed: stopped while unloading", lines
    assert supervisor.reloads == 0 and supervisor._state("slow") == "UNLOADING"  # no load was sent
    print(f"reload returned {time.monotonic() - stopped:.2f}s after the stop")


def test_dead_stub_after_a_rebuild_loads_the_new_build_whole_not_new_files_under_the_old_config(small_repo,
                                                                                                 tmp_path):
    """build-repo --force into a served repository, then a stub dies: the replacement is one coherent version
    (here the new build, max batch 4), never the new files under the served config (max batch 8)."""
    from support import build

    repo = tmp_path / "repo"
    shutil.copytree(small_repo, repo)
    serve = ServeRepo(repo)
    try:
        assert serve.http.get_model_config(SMALL)["max_batch_size"] == 8
        build(repo, "--max-batch-size", "4", "--force")
        mark = len(serve.lines)
        stub = next(s for s in faults.stubs_of(serve.triton_pid) if s.model == SMALL and s.alive)
        os.kill(stub.pid, signal.SIGKILL)
        serve.wait_for(f"{SMALL}: ready again", 120, mark)
        assert serve.seen("holds a new build of it", mark), serve.lines[mark:]
        assert serve.http.get_model_config(SMALL)["max_batch_size"] == 4
        batch = faults.image(3)
        assert faults.infer(serve.http, SMALL, batch).shape == (1, 1000)
    finally:
        serve.stop()


def test_stale_sweep_passes_over_a_zombie_stub_when_it_has_no_command_line(tmp_path, monkeypatch):
    # A zombie has no /proc/PID/cmdline: the sweep must not trip over it (nor kill anything for it).
    from server import procfs

    monkeypatch.setattr(procfs, "_processes", lambda comm: [(123456789, [], 1, "Z")])
    assert procfs.remove_stale(tmp_path / "tmp", tmp_path / "shm") == []


class _DyingProxy:
    """A proxy that starts and dies at once, every time (as when another program holds its port)."""

    WORDS = "[ALERT] (1) : Starting frontend http: cannot bind socket (Address already in use) [0.0.0.0:8000]"

    def __init__(self):
        self.starts, self.returncode = 0, None

    def running(self) -> bool:
        return False

    def _reap(self) -> None:
        self.returncode = 1

    def last_words(self) -> str:
        return self.WORDS

    def start(self):
        self.starts += 1
        return self


def test_proxy_that_keeps_dying_is_restarted_with_backoff_then_given_up_naming_its_last_words():
    import threading
    import time
    from types import SimpleNamespace

    from server.supervisor import Supervisor

    server = SimpleNamespace(running=lambda: True, stubs=lambda: [], loaded=[], repository=Path("/nonexistent"),
                             abandoned=set(), abandon=lambda pids=(), alive=None: set())
    proxy, lines = _DyingProxy(), []
    supervisor = Supervisor(server, max_restarts=3, poll_seconds=0.01, log=lines.append, proxy=proxy)
    stop = threading.Event()
    timer = threading.Timer(20, stop.set)
    timer.start()
    started = time.monotonic()
    try:
        status = supervisor.run(stop)
    finally:
        timer.cancel()
    took = time.monotonic() - started
    assert status == 1 and not stop.is_set(), f"still restarting after {took:.0f}s: {proxy.starts} starts"
    assert proxy.starts == 3  # --max-restarts in a row, then no more
    assert took >= 1.5, took  # restarted at once, then after at least 0.5 s and 1 s (the backoff's waits)
    assert "the proxy died (exit status 1)" in supervisor.failure and _DyingProxy.WORDS in supervisor.failure
    assert "not restarted: 3 restarts in a row" in supervisor.failure, supervisor.failure
    assert [line for line in lines if "restarting it (" in line][-1].endswith("(3/3) in 1s")


def test_proxy_whose_start_keeps_failing_is_given_up_naming_why_it_did_not_start():
    import threading
    from types import SimpleNamespace

    from server.supervisor import Supervisor
    from server.triton import ServerError

    class Refused(_DyingProxy):
        def start(self):
            self.starts += 1
            raise ServerError("http port 8000 on 0.0.0.0 is busy; choose another with --http-port")

    server = SimpleNamespace(running=lambda: True, stubs=lambda: [], loaded=[], repository=Path("/nonexistent"),
                             abandoned=set(), abandon=lambda pids=(), alive=None: set())
    proxy = Refused()
    supervisor = Supervisor(server, max_restarts=2, poll_seconds=0.01, log=lambda line: None, proxy=proxy)
    stop = threading.Event()
    timer = threading.Timer(20, stop.set)
    timer.start()
    try:
        assert supervisor.run(stop) == 1 and not stop.is_set()
    finally:
        timer.cancel()
    assert proxy.starts == 2
    assert supervisor.failure.startswith("the proxy did not start again: http port 8000 on 0.0.0.0 is busy")


def test_live_stubs_of_a_copy_whose_unload_never_ends_count_as_instances_never_freed(small_repo, start_server):
    """server.abandoned (where the TorchServe front gave up on an unload Triton never ends): those live stubs count
    with the dead ones past max_unfreed, and a drained restart frees them; pids no longer running are dropped."""
    from server.supervisor import Supervisor

    server = start_server(small_repo, drain_seconds=1)
    lines = []
    supervisor = Supervisor(server, log=lines.append, max_unfreed=1, unfreed_grace=0)
    stubs = [stub.pid for stub in server.stubs() if stub.alive and stub.serves]
    assert len(stubs) >= 2, stubs
    assert not supervisor.check_unfreed()  # nothing abandoned, nothing dead
    server.abandoned.update({stubs[0], 2 ** 22 + 1})  # one live stub, and a pid that is no stub of this server
    assert not supervisor.check_unfreed() and server.abandoned == {stubs[0]}  # 1: not more than max_unfreed
    server.abandoned.add(stubs[1])
    assert supervisor.check_unfreed()
    assert lines[-1].startswith("serve-repo: stopping tritonserver to free 2 instances it never freed"), lines
