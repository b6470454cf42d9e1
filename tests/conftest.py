"""Shared fixtures: a repository built by build-repo, a real tritonserver serving it, and a way to start more."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# Before torch (libgomp reads it when it loads), for this process and every one the tests start (servers, stubs,
# TorchServe's workers, builds): OpenMP threads that have no work sleep instead of spinning. The suite runs several
# torch processes on 2 cores; spinning threads took the cores from the ones with work: three processes running
# resnet18 side by side took 8.6-10.9 s of CPU for 20 batches each, 3.5-4.1 s with PASSIVE (numerics unchanged).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from server.triton import TritonServer
from support import LARGE, SMALL, build, reference_model


def pytest_configure(config):
    """Under pytest-xdist, each worker's own temporary folder (TMPDIR, for its subprocesses too): tools that stage in
    $TMPDIR/NAME (torch-model-archiver: $TMPDIR/MODEL_NAME) must not meet another worker's run of the same name."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        own = tempfile.mkdtemp(prefix=f"xd-{worker}-")
        os.chmod(own, 0o1777)  # as /tmp: linkchecker, run as root, reads as nobody (tests/test_docs_site.py)
        os.environ["TMPDIR"] = own
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        config.add_cleanup(lambda: shutil.rmtree(own, ignore_errors=True))


# The longest files (wall seconds with 2 workers, 2-core machine, 2026-11-28), started first under pytest-xdist: each
# file runs whole on one worker (--dist loadfile), so a long one left to the end runs alone while the other worker
# idles. The default serial run keeps pytest's order.
LONGEST_FIRST = ("test_torchserve_inference_cases.py", "test_torchserve_api.py", "test_torchserve_parity.py",
                 "test_gpu_round.py", "test_migrate.py", "test_proxy.py", "test_torchserve_snapshots.py",
                 "test_cpu_image.py", "test_torchserve_grpc.py", "test_torchserve_examples.py",
                 "test_torchserve_trust.py", "test_torchserve_explain.py")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts the same way, as xdist requires
        rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def repository(tmp_path_factory) -> Path:
    """Built once for the whole run: with pytest-xdist's workers, by the first that asks, in their common folder
    (the others wait on the lock); the tests read it, or copy what they change."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    repo, done = shared / "shared-repo" / "model_repository", shared / "shared-repo" / "built"
    with open(shared / "shared-repo.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build(repo, "--max-batch-size", "8", "--max-queue-delay-us", "2000", "--force")
            build(repo, "--max-batch-size", "8", "--force", model=LARGE)
            done.touch()
    return repo


@pytest.fixture(scope="session")
def server(repository):
    """A real tritonserver on free local ports, or the external one named by TRITON_URL."""
    external = os.environ.get("TRITON_URL")
    if external:
        yield SimpleNamespace(http_url=external, grpc_url=os.environ.get("TRITON_GRPC_URL", ""))
        return
    with TritonServer.local(repository) as running:
        yield running


@pytest.fixture
def start_server():
    """start_server(repository, **options): a real tritonserver on free local ports, ready; every server
    a test starts this way is stopped when the test ends, whatever happens in it."""
    started = []

    def start(repository, **options) -> TritonServer:
        server = TritonServer.local(repository, **options)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def small_model() -> torch.nn.Module:
    return reference_model(SMALL)
