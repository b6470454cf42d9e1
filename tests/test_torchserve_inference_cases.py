"""TorchServe's own inference cases (its test/postman/inference_data.json, copied unchanged to
tests/torchserve_examples/postman/) on TorchServe 0.12 and on serve-repo's TorchServe front, side by side: each row as
TorchServe's postman collection (inference_api_test_collection.json) plays it -- register the row's archive
(url, model_name, initial_workers, synchronous), POST the row's file to /predictions/<model_name>, DELETE the model --
and every answer compared: status, headers (test_torchserve_parity's COMPARED_HEADERS) and body.

The archives are made by tests/ts_inference_archives.py as TorchServe's tooling makes them (ts_scripts/mar_config.json;
the `_scripted` ones as the examples' READMEs), with seeded random weights; TORCH_HOME holds seeded random backbone
checkpoints for the model files that load pretrained ones. Both servers get the same store and config.properties
settings, no flag (no --trust-model-code: the store is the operator's, as under TorchServe).

The collection's request has no headers and turns postman's own content-type header off: the prediction is sent with
no Content-Type. A row's "content-type" is the type the collection checks the answer as ("text/plain": its body
equal to "expected"; "application/json": the image_classification validator on "expected").
"""
from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from perf import torchserve
from perf.serve import TorchServeFront
from support import ROOT
from test_torchserve_parity import different, headers_of
from ts_inference_archives import EAGER_FILE, archive_names, local, recipes

EXAMPLES = ROOT / "tests" / "torchserve_examples"
DATA = json.loads((EXAMPLES / "postman" / "inference_data.json").read_text())
# inference_data.json's rows not run here: their archives need Hugging Face transformers, which is not installed
OUT_OF_SCOPE = {
    "distill_bert_qa_eager": "needs transformers (not installed): its handler is a Hugging Face question answerer",
    "bert_token_classification_no_torchscript": "needs transformers (not installed): a Hugging Face BERT token "
                                                "classifier",
    "bert_seqc_without_torchscript": "needs transformers (not installed): a Hugging Face BERT sequence classifier",
}
# How each runnable row's prediction is compared (its registration and unregistration: byte for byte):
# "probabilities": an image classifier's top 5, the same classes in the same order, probabilities within 1e-4 (ours
# runs the model on OpenVINO: the last digits differ); "bytes": byte for byte -- MNIST's digit, and the detectors' and
# segmenters' JSON, which both servers compute with the same eager PyTorch on the same weights (OpenVINO takes no dict
# outputs) and which TorchServe answers the same in every run
CASES = {
    "squeezenet1_1": "probabilities", "squeezenet1_1_scripted": "probabilities",
    "densenet161": "probabilities",
    "alexnet": "probabilities", "alexnet_scripted": "probabilities",
    "resnet-18": "probabilities", "resnet-18_scripted": "probabilities",
    "vgg16": "probabilities", "vgg16_scripted": "probabilities",
    "mnist": "bytes", "mnist_scripted": "bytes",
    "fastrcnn": "bytes", "maskrcnn": "bytes",
    "fcn_resnet_101": "bytes", "fcn_resnet_101_scripted": "bytes",
    "deeplabv3_resnet_101_eager": "bytes", "deeplabv3_resnet_101_scripted": "bytes",
    "resnet152": "probabilities", "resnet-152-batch_scripted": "probabilities",
}
RUNNABLE = [row for row in DATA if row["model_name"] not in OUT_OF_SCOPE]


def archive_of(row: dict) -> str:
    """The archive a row's url names: {{mar_path_NAME}} (ts_scripts/marsgen.py's NAME.mar) or a URL's file name."""
    url = row["url"]
    if url.startswith("{{mar_path_"):
        return url.removeprefix("{{mar_path_").removesuffix("}}") + ".mar"
    return url.rsplit("/", 1)[1]


def call(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes, tuple]:
    """(status, body, headers_of the answer); a body goes with no Content-Type, as the collection sends it."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=body)
        reply = connection.getresponse()
        return reply.status, reply.read(), headers_of(reply.headers)
    finally:
        connection.close()


def made(store: Path, builder: subprocess.Popen, file: str, timeout: float = 600) -> None:
    """Once the builder has moved `file` into the store (it makes them in the rows' order, as the servers play them)."""
    deadline = time.monotonic() + timeout
    while not (store / file).is_file():
        if builder.poll() is not None or time.monotonic() > deadline:  # ended (or stuck) without it
            raise AssertionError(f"{file} not made (builder: {builder.poll()}): {builder_log(store)}")
        time.sleep(0.2)


def builder_log(store: Path) -> str:
    return (store.parent / "builder.log").read_text(errors="replace")[-3000:]


def play(inference: str, management: str, store: Path, builder: subprocess.Popen) -> dict[str, list[tuple]]:
    """Every runnable row, one after the other, as the collection plays them: [registration, prediction,
    unregistration] answers by model name. (Two rows at a time took longer: our front's registrations and
    unregistrations wait on each other, an unregistration beside a registration up to 18 s.)"""
    answers = {}
    for row in RUNNABLE:
        name = row["model_name"]
        made(store, builder, archive_of(row))
        query = urllib.parse.urlencode({"url": archive_of(row), "model_name": name, "initial_workers": row["worker"],
                                        "synchronous": row["synchronous"]})
        registered = call("POST", f"{management}/models?{query}")
        predicted = call("POST", f"{inference}/predictions/{name}", local(row["file"]).read_bytes())
        answers[name] = [registered, predicted, call("DELETE", f"{management}/models/{name}")]
    return answers


SETTINGS = {"enable_model_api": "true"}


def theirs(store: Path, builder: subprocess.Popen, folder: Path) -> dict[str, list[tuple]]:
    with torchserve.started(folder, None, None, store=store, properties=SETTINGS) as real:
        return play(real.inference_url, real.management_url, store, builder)


def ours(store: Path, builder: subprocess.Popen, folder: Path) -> dict[str, list[tuple]]:
    front = TorchServeFront(folder, model_store=str(store), disable_token_authorization="true", **SETTINGS)
    try:
        return play(front.inference_url, front.management_url, store, builder)
    finally:
        front.stop()


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[dict, dict]:
    """(ours, TorchServe's): the two servers play the rows side by side on one store, with the same TORCH_HOME (the
    backbones' checkpoints), while tests/ts_inference_archives.py makes the archives in the rows' order."""
    folder = tmp_path_factory.mktemp("inference-cases")
    store, torch_home = folder / "model_store", folder / "torch_home"
    store.mkdir()
    by_file = {EAGER_FILE.get(recipe["model_name"], recipe["model_name"]): recipe["model_name"] for recipe in recipes()}
    order = [by_file[archive_of(row).removesuffix(".mar")] for row in RUNNABLE if archive_of(row).removesuffix(".mar")
             in by_file]
    with open(folder / "builder.log", "wb") as log:
        builder = subprocess.Popen([sys.executable, "-m", "tests.ts_inference_archives", str(store), str(torch_home),
                                    *order], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TORCH_HOME", str(torch_home))
            with ThreadPoolExecutor(1) as pool:
                reference = pool.submit(theirs, store, builder, tmp_path_factory.mktemp("torchserve"))
                mine = ours(store, builder, tmp_path_factory.mktemp("front"))
                reference = reference.result()
        assert builder.wait(600) == 0, builder_log(store)
        return mine, reference
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
        for made_here in (store, torch_home):  # 3.5 GB of archives and checkpoints, kept by pytest where a test failed
            shutil.rmtree(made_here, ignore_errors=True)


def test_the_cases_are_inference_data_rows_but_the_three_that_need_transformers():
    names = [row["model_name"] for row in DATA]
    assert len(names) == 22 and len(set(names)) == 22
    assert set(OUT_OF_SCOPE) <= set(names)
    assert list(CASES) == [name for name in names if name not in OUT_OF_SCOPE]
    assert len(CASES) == 19
    # each runnable row's archive is one the builder makes, and its file one copied here
    assert sorted(archive_of(row) for row in RUNNABLE) == sorted(f"{name}.mar" for name in archive_names())
    assert all(local(row["file"]).is_file() for row in RUNNABLE)
    # a row the collection checks as an image classification is compared as one
    assert all(CASES[row["model_name"]] == "probabilities"
               for row in RUNNABLE if row.get("validator") == "image_classification")


STEPS = ("register", "predict", "unregister")


def test_each_runnable_row_answers_as_torchserve_0_12(answers):
    mine, reference = answers
    assert list(mine) == list(reference) == list(CASES)
    found = []
    for name, compare in CASES.items():
        for step, ours_, theirs_ in zip(STEPS, mine[name], reference[name]):
            why = different(compare if step == "predict" else "bytes", ours_, theirs_)
            if why is not None:
                found.append(f"{name} {step}: {why}\n  ours:   {ours_[0]} {ours_[2]} {ours_[1][:300]!r}\n"
                             f"  theirs: {theirs_[0]} {theirs_[2]} {theirs_[1][:300]!r}")
    assert not found, f"{len(found)} of {len(CASES) * 3} answers differ:\n" + "\n".join(found)


def test_torchserve_answers_the_rows_as_the_collection_expects_of_it(answers):
    """The collection's own checks on TorchServe's answers (200, the MNIST digit's text), so that a row both servers
    fail alike cannot pass."""
    _, reference = answers
    for row in RUNNABLE:
        (registered, _, _), predicted, (unregistered, _, _) = reference[row["model_name"]]
        assert (registered, predicted[0], unregistered) == (200, 200, 200), (row["model_name"], predicted)
        answer = json.loads(predicted[1]) if row.get("content-type") != "text/plain" else predicted[1].decode()
        if row.get("content-type") == "text/plain":
            assert len(answer) == 1 and answer in "0123456789", answer  # random weights: a digit, not "0"
        elif row.get("validator") == "image_classification":
            assert len(answer) == 5 and max(answer.values()) < 0.9, answer  # not one 1.0 and four zeros
        elif "rcnn" in row["model_name"]:  # the box predictor's scaled class layer: boxes pass the 0.5 threshold
            assert answer and all(len(box) == 2 and "score" in box for box in answer), answer[:3]
        else:  # a segmenter: 224 x 224 pixels of [class, probability], of several classes and probabilities
            pixels = np.asarray(answer)
            assert pixels.shape == (224, 224, 2), pixels.shape
            assert len(np.unique(pixels[..., 0])) > 1 and pixels[..., 1].max() < 1, row["model_name"]
