"""build-repo under faults: one line and a non-zero exit, checked early; interrupted builds leave nothing."""
import compileall
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder import cli as build_repo
from builder import repository, sources
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


# A signal landing inside the swap or the cleanup, injected at the exact moment (not a timed kill). The
# previous repository is a --max-batch-size 8 build with NAME_torchscript; the rebuild (--force) writes the
# three models with --max-batch-size 4 and retires NAME_torchscript.
_NEW = [SMALL, f"{SMALL}_image", f"{SMALL}_preprocess"]


@pytest.fixture(scope="module")
def previous_build(tmp_path_factory):
    repo = tmp_path_factory.mktemp("previous") / "repo"
    build(repo, "--engine", "torch", "--formats", "python,torchscript", "--max-batch-size", "8")
    return repo


@pytest.fixture
def repo(previous_build, tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(previous_build, copy)
    handler = signal.getsignal(signal.SIGTERM)  # build-repo's main installs its own
    yield copy
    signal.signal(signal.SIGTERM, handler)


def _models(repo):
    return {model.name: {path.relative_to(model).as_posix(): path.read_bytes() if path.is_file() else None
                         for path in sorted(model.rglob("*"))} for model in repo.iterdir()}


def _outcome(repo, before):
    """previous: every model as it was; new: the rebuild's three models, whole, and nothing else; or what broke."""
    after = _models(repo)
    if after == before:
        return "previous"
    if sorted(after) == sorted(_NEW) and all(after[name].keys() == before[name].keys() and
                                             b"max_batch_size: 4" in after[name]["config.pbtxt"] for name in _NEW):
        return "new"
    return {name: ("lost" if name not in after else "previous" if after[name] == before.get(name) else
                   "new" if b"max_batch_size: 4" in after[name].get("config.pbtxt", b"") else "broken")
            for name in sorted({*before, *after})}


def _rebuild_signalled(repo, capsys):
    """build-repo --force over `repo`, signalled where the test's patch signals: it exits 130 leaving no staging
    folder, and every model previous or every model new, as its message says."""
    before = _models(repo)
    status = build_repo.main(_argv(repo, "--engine", "torch", "--max-batch-size", "4", "--force"))
    err = capsys.readouterr().err
    outcome = _outcome(repo, before)
    assert not list(repo.parent.glob(".repo-build-*")), f"staging folder left; repository: {outcome}"
    assert outcome in ("previous", "new"), outcome
    assert status == 130, err
    # The message says which of the two the repository holds.
    assert ("nothing was written" if outcome == "previous" else "the new models were already in place") in err, err
    return outcome


def _signal(signum=signal.SIGTERM):
    signal.raise_signal(signum)  # in this process: its handler runs before this returns


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_between_the_two_renames_of_a_swap_loses_no_model(repo, capsys, monkeypatch, signum):
    """The previous model renamed into the staging folder, the new one not yet in its place."""
    rename, fired = Path.rename, []

    def rename_then_signal(self, target):
        moved = rename(self, target)
        if Path(target).name.endswith(".old") and not fired:
            fired.append(target)
            _signal(signum)
        return moved
    monkeypatch.setattr(Path, "rename", rename_then_signal)
    _rebuild_signalled(repo, capsys)
    assert fired


@pytest.mark.parametrize("after", [1, len(_NEW)], ids=["between-two-models", "before-the-retirement"])
def test_sigterm_between_swaps_leaves_all_models_previous_or_all_new(repo, capsys, monkeypatch, after):
    swap_in, calls = repository.swap_in, []

    def swap_then_signal(built, target):
        swapped = swap_in(built, target)
        calls.append(target)
        if len(calls) == after:
            _signal()
        return swapped
    monkeypatch.setattr(repository, "swap_in", swap_then_signal)
    _rebuild_signalled(repo, capsys)
    assert len(calls) >= after


def _rmtree_signalled(monkeypatch):
    """shutil.rmtree of a staging folder signalled halfway: after its first entry is gone."""
    rmtree, fired = shutil.rmtree, []

    def rmtree_with_signal(path, *args, **kwargs):
        if Path(path).name.startswith(".repo-build-") and not fired and Path(path).exists():
            rmtree(next(Path(path).iterdir()))
            fired.append(path)
            _signal()
        return rmtree(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", rmtree_with_signal)
    return fired


def test_sigterm_during_the_cleanup_after_the_swap_leaves_no_staging(repo, capsys, monkeypatch):
    fired = _rmtree_signalled(monkeypatch)
    _rebuild_signalled(repo, capsys)
    assert fired


def test_second_sigterm_during_the_cleanup_of_an_interrupted_build_leaves_no_staging(repo, capsys, monkeypatch):
    """Ctrl-C twice: the first ends the build before the swap, the second lands in its cleanup."""
    fired = _rmtree_signalled(monkeypatch)

    def interrupted(*args, **kwargs):
        _signal()
    monkeypatch.setattr(compileall, "compile_dir", interrupted)
    assert _rebuild_signalled(repo, capsys) == "previous"
    assert fired
