"""Explanations of an image_classifier archive served on the image path (issue 45): TorchServe's own handler loaded
as a second Triton model on the first explanation (server/torchserve/explainers.py), predictions answered meanwhile,
unloaded with the model, a failed load TorchServe's 503. TorchServe 0.12's own answers to the same explanations
(status, shape, attributions): tests/parity_table.py's explanation rows."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

from common.build_result import BuildResult
from perf import torchserve
from perf.serve import TorchServeFront
from server.errors import ServerError
from server.procfs import stubs_of
from server.torchserve import explainers
from server.torchserve.archives import ArchiveInfo
from server.torchserve.explainers import Explainers
from server.torchserve.inference import Inference
from server.torchserve.registry import Model
from support import ROOT
from test_torchserve_api import call

PHOTO = (ROOT / "clients" / "samples" / "chelsea.jpg").read_bytes()
NAME = "r18"
EXPLAINER = f"{NAME}_explain"
LOADED = f"explanations answered by {EXPLAINER}"  # the log line of each explainer load


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """Our TorchServe front serving a small image_classifier archive (resnet18, seeded) on the image path."""
    folder = tmp_path_factory.mktemp("explain")
    made = torchserve.resnet_archive(folder / "model_store", NAME, None, None, None, arch="resnet18", fc_scale=0.01)
    started = TorchServeFront(folder / "front", "--trust-model-code", model_store=str(made.parent),
                              load_models=f"{NAME}={made.name}", enable_model_api="true",
                              disable_token_authorization="true", default_workers_per_model="1")
    yield started
    started.stop()


def _stubs(front) -> Counter:
    """The live python-backend stubs under the front's tritonserver, by Triton model."""
    triton = next(p for p in psutil.Process(front.process.pid).children(recursive=True)
                  if p.name().startswith("tritonserver"))
    return Counter(stub.model for stub in stubs_of(triton.pid) if stub.alive and stub.serves)


def _explain(front, path: str = f"/explanations/{NAME}") -> tuple[int, bytes, float]:
    began = time.monotonic()
    status, body = call("POST", front.inference_url + path, PHOTO)
    return status, body, time.monotonic() - began


def test_first_explanations_load_one_explainer_and_answer_attributions_when_asked_together(front):
    before = _stubs(front)
    assert before and not before[EXPLAINER], before  # the image path's stubs, nothing for explanations until asked
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda path: _explain(front, path),
                              [f"/explanations/{NAME}", f"/v1/models/{NAME}:explain"]))
    later = _explain(front, f"/v2/models/{NAME}/explain")
    print(f"first explanations (the load included): {[round(t, 2) for _, _, t in first]} s; a later one "
          f"{later[2]:.2f} s")
    assert [status for status, _, _ in [*first, later]] == [200] * 3, first[0][1][:300]
    attributions = np.asarray(json.loads(first[0][1]), dtype=np.float64)
    # captum's IntegratedGradients of the photo's 3 x 224 x 224 input, as TorchServe's image_classifier answers
    assert attributions.shape == (3, 224, 224) and np.isfinite(attributions).all() and np.abs(attributions).max() > 0
    assert first[1][1] == first[0][1] == later[1]  # the same photo, the same weights: the same attributions
    assert len([line for line in front.lines if LOADED in line]) == 1  # loaded once, for both first explanations
    assert _stubs(front) == before + Counter({EXPLAINER: 1})
    status, body = call("GET", f"{front.management_url}/models/{NAME}")
    described = json.loads(body)[0]
    assert status == 200 and len(described["workers"]) == 1 and "_explain" not in body.decode()


def test_a_prediction_answers_while_an_explanation_of_its_model_is_in_flight_when_sent_during_it(front):
    alone = call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO)
    with ThreadPoolExecutor(2) as pool:
        explaining = [pool.submit(_explain, front) for _ in range(2)]  # batch size 1: one after the other
        time.sleep(0.25)  # both sent and the first explaining (one takes over a second here)
        began = time.monotonic()
        during = call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO)
        took = time.monotonic() - began
        in_flight = [not future.done() for future in explaining]
        explained = [future.result() for future in explaining]
    print(f"a prediction during explanations: {took:.2f} s; the explanations "
          f"{[round(t, 2) for _, _, t in explained]} s")
    assert during == alone and alone[0] == 200  # the image path's answer, unchanged
    assert [status for status, _, _ in explained] == [200, 200]
    assert all(in_flight), "the prediction waited for the explanations"


def test_scale_to_zero_and_unregister_unload_the_explainer_and_snapshots_never_name_it_when_done(front):
    if not _stubs(front)[EXPLAINER]:
        assert _explain(front)[0] == 200
    management = f"{front.management_url}/models/{NAME}"
    assert call("PUT", f"{management}?min_worker=0&synchronous=true")[0] == 200
    _wait_gone(front, EXPLAINER)
    status, body, _ = _explain(front)  # no worker: TorchServe's answer, nothing loaded
    assert status == 503 and "has no worker" in json.loads(body)["message"] and not _stubs(front)[EXPLAINER]
    assert call("PUT", f"{management}?min_worker=1&synchronous=true")[0] == 200
    loads = len([line for line in front.lines if LOADED in line])
    assert _explain(front)[0] == 200 and _stubs(front)[EXPLAINER] == 1
    assert len([line for line in front.lines if LOADED in line]) == loads + 1  # loaded again (from the cache)
    assert call("DELETE", management)[0] == 200
    _wait_gone(front, EXPLAINER)
    snapshots = sorted((front.folder / "logs" / "config").glob("*.cfg"))
    assert snapshots and not [path.name for path in snapshots if "_explain" in path.read_text()]


def _wait_gone(front, model: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while _stubs(front)[model] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _stubs(front)[model], f"{model}'s stub still serves"


class _Triton:
    """The server side of a registry: every load fails, as Triton's for a handler that cannot start."""

    def __init__(self, repository: Path):
        self.repository, self.loaded, self.loads, self.unloads = repository, ["m", "m_image"], [], []

    def load(self, name: str) -> None:
        self.loads.append(name)
        raise ServerError(f"load {name}: failed to load '{name}': ModuleNotFoundError: No module named 'captum'")

    def unload(self, name: str) -> None:
        self.unloads.append(name)


def test_an_explainer_that_fails_to_load_answers_503_and_leaves_the_rest_when_asked_again(tmp_path, monkeypatch):
    built = tmp_path / "cache" / "build"
    (built / "m_explain" / "1").mkdir(parents=True)
    (built / "m_explain" / "config.pbtxt").write_text('name: "m_explain"\nbackend: "python"\nmax_batch_size: 1\n')
    monkeypatch.setattr(explainers, "build_registered", lambda *args: (built, BuildResult()))
    logged: list[str] = []
    registry = type("FakeRegistry", (), {})()
    registry.server, registry.cache, registry.max_pixels = _Triton(tmp_path / "repo"), tmp_path / "cache", None
    registry.log = logged.append
    monkeypatch.setattr(explainers, "wait_unloaded", lambda *args: None)
    registry.explainers = Explainers(registry)
    info = ArchiveInfo(tmp_path / "m.mar", "m.mar", "m", "1.0", "image_classifier", None, "0" * 64)
    model = Model("m", "1.0", info, "m", 1, 100, 1, 120, True, members=["m", "m_image"])
    inference = Inference(registry, "127.0.0.1:1", 1 << 20, 100, log=logged.append)
    answers = [asyncio.run(inference.prediction(model, PHOTO, {}, explain=True)) for _ in range(2)]
    assert [(a.status_code, json.loads(a.body)) for a in answers] == [
        (503, {"code": 503, "type": "InternalServerException", "message": "Prediction failed"})] * 2
    server = registry.server
    assert server.loads == ["m_explain"] * 2  # tried again by the next explanation
    assert server.unloads == ["m_explain"] * 2 and not (server.repository / "m_explain").exists()
    assert server.loaded == ["m", "m_image"] and model.explainer is None and model.members == ["m", "m_image"]
    assert model.pending == model.queued == 0
    assert any("explainer could not be loaded" in line and "No module named 'captum'" in line for line in logged)
