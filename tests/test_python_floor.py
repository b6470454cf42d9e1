"""pyproject's floor, Python 3.10, run for real: the whole project resolves there, every module that needs no torch
imports there, and the tests that need no torch pass there (the TorchServe front, serve-repo's process, a stub).

make setup builds .venv310 with tools/floor_env.py where a python3.10 is found (PATH, $PYTHON310, pyenv), without
torch (its 3.10 build is several GB): what needs torch is checked on 3.10 only by tests/test_layout.py's grammar."""
import importlib.util
import json
import os
import re
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement

from support import ROOT

VENV = ROOT / ".venv310"
_spec = importlib.util.spec_from_file_location("floor_env", ROOT / "tools" / "floor_env.py")
floor_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor_env)

# What a module may miss on 3.10 here: torch, and what exists only inside Triton's stub or comes with a torch model.
MAY_MISS = {"torch", "torchvision", "triton_python_backend_utils", "efficientnet_lite_pytorch"}
# Test files that need neither torch nor a model built with it, and within them the tests that build one (or read
# an archive through build-repo, which imports torch).
FLOOR_TESTS = ["test_echo_stub.py", "test_config.py", "test_docs.py", "test_server_process.py",
               "test_torchserve_bench.py", "test_torchserve_contract.py", "test_torchserve_flags.py",
               "test_torchserve_hostile.py", "test_torchserve_limits.py", "test_torchserve_private.py",
               "test_torchserve_properties.py"]
BUILD_A_MODEL = ["test_torchserve_contract.py::test_the_front_takes_build_repos_error_from_its_json",
                 "test_torchserve_contract.py::test_build_repo_and_the_front_read_an_archives_labels",
                 "test_torchserve_contract.py::test_build_repo_and_the_front_read_an_archives_model_config"]
_IMPORT_ALL = """
import importlib, json, pathlib, sys
found = {"ok": [], "missing": {}, "broken": {}}
for room in sys.argv[1:]:
    for path in sorted(pathlib.Path(room).rglob("*.py")):
        name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
        try:
            importlib.import_module(name)
            found["ok"].append(name)
        except ModuleNotFoundError as exc:
            found["missing"][name] = exc.name.split(".")[0]
        except BaseException as exc:
            found["broken"][name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def floor_python() -> str:
    python = VENV / "bin" / "python"
    if python.exists():
        return str(python)
    found = floor_env.find_floor_python()
    if found:
        pytest.fail(f"a Python 3.10 is here ({found}) but {VENV.name}/ is not: run make setup")
    pytest.skip("no Python 3.10 on this machine (PATH, $PYTHON310, pyenv): only tests/test_layout.py's grammar "
                "checks the floor here")


def _run(python: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_whole_project_resolves_on_python_3_10_as_pyproject_pins_it_when_set_up(floor_python):
    resolved = json.loads((VENV / "resolved.json").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = {"python_version": "3.10", "python_full_version": "3.10.0"}
    checked = []
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(spec)
        if requirement.marker is None or requirement.marker.evaluate(floor):
            name = requirement.name.lower()
            assert name in resolved and requirement.specifier.contains(resolved[name]), (spec, resolved.get(name))
            checked.append(name)
    assert {"torch", "torchvision", "nvidia-pytriton", "starlette", "python-multipart"} <= set(checked)
    assert project["requires-python"] == ">=3.10"


def test_every_module_that_needs_no_torch_imports_on_python_3_10_when_imported(floor_python):
    rooms = ["common", "builder", "server", "backends", "clients", "perf", "drills", "examples"]
    done = _run(floor_python, "-c", _IMPORT_ALL, *rooms, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert not found["broken"]
    assert set(found["missing"].values()) <= MAY_MISS, found["missing"]
    every_server_module = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                           for p in (ROOT / "server").rglob("*.py")}
    assert every_server_module <= set(found["ok"]), sorted(every_server_module - set(found["ok"]))


def test_tests_that_need_no_torch_pass_on_python_3_10_when_run(floor_python):
    deselect = [arg for test in BUILD_A_MODEL for arg in ("--deselect", f"tests/{test}")]
    done = _run(floor_python, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", *deselect,
                *[f"tests/{name}" for name in FLOOR_TESTS], timeout=300)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    # What went wrong, not the durations printed after it: from the first ERRORS / FAILURES section on.
    marks = [done.stdout.find(mark) for mark in ("= ERRORS =", "= FAILURES =") if mark in done.stdout]
    assert done.returncode == 0, done.stdout[min(marks):][:8000] if marks else done.stdout[-4000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 90 and "failed" not in summary, summary
