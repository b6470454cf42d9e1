"""Ready means right: serve-repo, the supervisor and the TorchServe front send each served model one canary request
and refuse to call a model ready when its answer is empty, NaN or of the wrong shape or dtype (issue 41)."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common.build_request import BuildRequest
from common.modelconfig import from_json
from common.procs import free_port
from server import canary, cli
from support import SMALL

# A classifier's model.py that answers wrong, as the NumPy 2 stub did (empty LOGITS) or with NaNs; where WRONG_IF
# names a file, only once that file exists (until then right: zeros of the declared shape).
_WRONG_MODEL = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils

HOW = {how!r}


class TritonPythonModel:
    def execute(self, requests):
        wrong = os.path.exists(os.environ.get("WRONG_IF", "/"))
        answers = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().shape[0]
            if not wrong:
                logits = np.zeros((rows, 1000), np.float32)
            elif HOW == "empty":
                logits = np.zeros((0,), np.float32)
            else:
                logits = np.full((rows, 1000), np.nan, np.float32)
            answers.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("LOGITS", logits)]))
        return answers
'''


def _wrong_repo(repository: Path, folder: Path, how: str) -> Path:
    """resnet18's built model (its config, two instances) with model.py replaced: no torch in its stubs (fast)."""
    shutil.copytree(repository / SMALL, folder / SMALL, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / SMALL / "1" / "model.py").write_text(_WRONG_MODEL.format(how=how))
    return folder


CLASSIFIER_JSON = {"name": "m", "max_batch_size": 8,
              "input": [{"name": "IMAGE", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}],
              "output": [{"name": "LOGITS", "data_type": "TYPE_FP32", "dims": [1000]}]}
CLASSIFIER = from_json(CLASSIFIER_JSON)  # as serve-repo reads Triton's answer


@pytest.mark.parametrize("answer, named", [
    (np.zeros((0,), np.float32), "LOGITS empty: float32 shape (0,) [], expected shape (1, 1000)"),
    (np.full((1, 1000), np.nan, np.float32), "1000 of 1000 values not finite"),
    (np.zeros((1, 10), np.float32), "LOGITS float32 shape (1, 10) [0. 0. 0. 0.] ..., expected shape (1, 1000)"),
    (np.zeros((1, 1000), np.float64), "expected dtype float32"),
])
def test_canary_names_the_output_and_shows_it_when_the_answer_is_wrong(answer, named):
    assert named in canary.wrong(CLASSIFIER, {"LOGITS": answer})


def test_canary_accepts_a_finite_answer_of_the_declared_shape_and_dtype():
    assert canary.wrong(CLASSIFIER, {"LOGITS": np.ones((1, 1000), np.float32)}) is None


def test_canary_inputs_follow_the_config_and_a_handlers_body_is_skipped_saying_why():
    (image,) = canary.canary_inputs(CLASSIFIER)
    assert (image.name(), image.shape(), image.datatype()) == ("IMAGE", [1, 3, 224, 224], "FP32")
    jpeg = from_json({**CLASSIFIER_JSON, "input": [{"name": "IMAGE_BYTES", "data_type": "TYPE_STRING", "dims": [1]}]})
    (encoded,) = canary.canary_inputs(jpeg)
    assert (encoded.shape(), encoded.datatype()) == ([1, 1], "BYTES") and canary.tiny_jpeg()[:2] == b"\xff\xd8"
    handler = from_json({**CLASSIFIER_JSON, "input": [{"name": "BODY", "data_type": "TYPE_STRING", "dims": [1]}]})
    assert "no declared test input" in canary.canary_inputs(handler)


def test_canary_probes_an_ensembles_classifier_and_not_its_preprocess_alone():
    ensemble = from_json({"platform": "ensemble", "output": [{"name": "LOGITS"}], "ensemble_scheduling": {"step": [
        {"model_name": "m_preprocess"}, {"model_name": "m"}]}})
    configs = {"m": CLASSIFIER, "m_preprocess": from_json({"output": [{"name": "IMAGE"}]}), "m_image": ensemble}
    assert canary.targets(configs) == ["m", "m_image"]
    assert canary.targets(configs, ["m_preprocess"]) == ["m_image"]  # a replaced step: its ensemble is probed


@pytest.mark.parametrize("how, proxy", [("empty", "off"), ("nan", "on")])
def test_serve_repo_exits_1_naming_the_model_and_its_answer_when_a_model_answers_wrong_at_start(
        repository, tmp_path, capsys, how, proxy):
    ports = [str(free_port()) for _ in range(3)]
    status = cli.main(["--repository", str(_wrong_repo(repository, tmp_path, how)), "--proxy", proxy,
                       "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]])
    out, err = capsys.readouterr()
    assert status == 1
    line = f"serve-repo: error: model {SMALL} answered wrong to the canary: LOGITS "
    assert line in err and err.count("\n") == 1, err
    assert ("shape (0,)" if how == "empty" else "[nan nan nan nan]") in err
    assert "ready" not in out, out


def test_supervisor_counts_a_replacement_that_answers_wrong_as_failed_not_ready_again(repository, tmp_path,
                                                                                       start_server):
    from server.supervisor import Supervisor

    marker = tmp_path / "wrong-from-now-on"
    server = start_server(_wrong_repo(repository, tmp_path / "repo", "nan"), env={"WRONG_IF": str(marker)})
    assert canary.run(server).probed == [SMALL]  # right until the marker exists
    lines = []
    supervisor = Supervisor(server, log=lines.append)
    supervisor.check_stubs()  # knows the live stubs
    marker.touch()
    victim = next(stub for stub in server.stubs() if stub.model == SMALL and stub.alive)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120  # "never", not a speed: measured ~2 s
    while not supervisor.failed_reloads and time.monotonic() < deadline:
        supervisor.check_stubs()
        time.sleep(0.25)
    assert supervisor.failed_reloads == 1 and supervisor.reloads == 0, lines
    assert f"serve-repo: {SMALL}: replacement failed after" in lines[-1], lines
    assert "answered wrong to the canary: LOGITS float32 shape (1, 1000) [nan nan nan nan]" in lines[-1]
    assert not any("ready again" in line for line in lines), lines


def test_torchserve_front_refuses_a_registration_with_500_when_its_model_answers_wrong(repository, tmp_path,
                                                                                      start_server, monkeypatch):
    """The registry's path for a failed load (TorchServe's 500 InternalServerException), the archive's reading and
    build stood in for by a built folder whose classifier answers NaN."""
    from server.torchserve import registry as registered
    from server.torchserve.archives import ArchiveInfo
    from server.torchserve.refusals import Refusal

    built = _wrong_repo(repository, tmp_path / "built", "nan")
    info = ArchiveInfo(tmp_path / "wrong.mar", "wrong.mar", SMALL, "1.0", "image_classifier", None, "0")
    monkeypatch.setattr(registered, "locate", lambda url, store, **options: info.path)
    monkeypatch.setattr(registered, "inspect", lambda path, url: info)
    from common.build_result import BuildResult, BuiltModel

    result = BuildResult(str(built), (BuiltModel(SMALL, "classifier"),))  # build-repo --json's, for that folder
    monkeypatch.setattr(registered, "build_registered", lambda *args, **options: (built, result))
    (tmp_path / "served").mkdir()
    server = start_server(tmp_path / "served")
    lines = []
    registry = registered.Registry(server, tmp_path, tmp_path / "cache", BuildRequest(), None, 100, lines.append)
    with pytest.raises(Refusal) as refused:
        registry.register("wrong.mar")
    assert (refused.value.status, refused.value.kind) == (500, "InternalServerException")
    # TorchServe's words to the client (its answer when workers fail to start); why, in the log
    assert str(refused.value) == f"Failed to start workers for model {SMALL} version: 1.0"
    assert any(f"Failed to load model {SMALL}: model {SMALL} answered wrong to the canary: LOGITS" in line
               for line in lines), lines
    assert registry.models == {} and SMALL not in server.loaded and not server.model_ready(SMALL)
    assert not (server.repository / SMALL).exists()


def test_canary_line_says_what_was_not_probed_and_why():
    report = canary.Report(["m", "m_image"], {"h": "input BODY is bytes of no declared test input"},
                           {"m_preprocess": "m_image"}, 0.123)
    assert report.line() == ("canary: m, m_image answered right (0.12s); m_preprocess through m_image; h not probed: "
                             "input BODY is bytes of no declared test input")
    assert canary.Report(skipped={"h": "why"}).line() == "canary: nothing probed; h not probed: why"
