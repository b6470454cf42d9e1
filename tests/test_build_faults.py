"""build-repo under faults: one line and a non-zero exit, checked early; interrupted builds leave nothing."""
import os
import signal
import subprocess
import sys
import time

import pytest

from builder import cli as build_repo
from builder import sources
from support import SMALL, build


def _argv(output, *extra):
    return ["--model", SMALL, "--weights", "random", "--output", str(output), "--kind", "cpu", *extra]


def test_build_repo_refuses_unwritable_output_before_loading_the_model_when_parent_is_a_file(tmp_path, capsys,
                                                                                                 monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(sources, "load_classifier", lambda *a: pytest.fail("loaded the model first"))
    assert build_repo.main(_argv(tmp_path / "file" / "repo")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("build-repo: error: cannot write the repository") and len(err.splitlines()) == 1


def test_build_repo_prints_one_line_when_weights_file_is_corrupt(tmp_path, capsys):
    (tmp_path / "broken.pt").write_bytes(b"PK\x03\x04 this is not a torch file" * 10)
    assert build_repo.main(["--model", SMALL, "--weights", str(tmp_path / "broken.pt"),
                            "--output", str(tmp_path / "repo"), "--kind", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot read a state_dict" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "repo" / SMALL).exists()


def test_build_repo_removes_stale_staging_when_its_builder_is_gone(tmp_path):
    repo = tmp_path / "repo"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".repo-build-{dead.pid}-abc123"
    (stale / "exports").mkdir(parents=True)
    build(repo)
    assert not stale.exists()
    assert not list(tmp_path.glob(".repo-build-*"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_build_leaves_no_staging_and_the_previous_repository_when_signalled(tmp_path, signum):
    repo = tmp_path / "repo"
    build(repo)
    weights = repo / SMALL / "1" / "weights.pt"
    before = weights.stat().st_mtime_ns
    # The ONNX export is the native part that used to abort (exit 134) on Ctrl-C.
    process = subprocess.Popen([sys.executable, "-m", "builder.cli", *_argv(repo, "--formats", "python,onnx",
                                                                            "--force")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".repo-build-*/exports")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the build ended before it could be interrupted"
    os.kill(process.pid, signum)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err[-2000:]
    assert "interrupted; nothing was written" in err
    assert not list(tmp_path.glob(".repo-build-*"))
    assert weights.stat().st_mtime_ns == before and not (repo / f"{SMALL}_onnx").exists()


def test_build_fails_naming_the_fix_when_pretrained_weights_cannot_be_had(tmp_path, capsys, monkeypatch):
    """Offline, --weights auto must not ship a meaningless model: it fails unless random weights are asked for."""
    from builder import weights

    def offline(_):
        raise OSError("no network")
    monkeypatch.setattr(weights, "_download", offline)
    repo = tmp_path / "repo"
    status = build_repo.main(["--model", "resnet18", "--weights", "auto", "--output", str(repo), "--kind", "cpu"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1, err
    assert "cannot be had here" in err and "--weights random" in err, err
    assert not (repo / "resnet18").exists()
    assert build_repo.main(["--model", "resnet18", "--weights", "random", "--output", str(repo), "--kind", "cpu"]) == 0
