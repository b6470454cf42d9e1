"""TorchServe's trust, TorchServe's rules (issue 44): a store that TorchServe 0.12 serves is served unchanged, with no
--trust-model-code: its MNIST example (a model file and a custom handler) and a densenet161-like archive (its
model.py overrides load_state_dict) register at start and answer as TorchServe answers; an archive downloaded from
a URL that allowed_urls admits runs its code too, as TorchServe runs it. And a custom handler's stub killed with a
batch in flight does not hold up the model's unregistration."""
from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.model_code import import_model_class
from examples.migrate_torchserve import run_archiver
from perf import torchserve
from perf.serve import TorchServeFront
from test_torchserve_api import call
from support import ROOT

MNIST = ROOT / "tests" / "torchserve_examples" / "mnist"
DIGIT = MNIST / "test_data" / "3.png"
PHOTO = ROOT / "clients" / "samples" / "chelsea.jpg"
LABELS = {str(i): ["n%08d" % i, name] for i, name in enumerate(["tench", "goldfish", "shark", "hen", "cock"])}
# TorchServe's densenet161 example's model.py, on a DenseNet small enough for a test (5 classes: the answer's
# top 5 is every class, so no near-tie can reorder it between eager PyTorch and OpenVINO).
DENSENET = '''import re

from torchvision.models.densenet import DenseNet


class ImageClassifier(DenseNet):
    def __init__(self):
        super(ImageClassifier, self).__init__(4, (2, 2), 8, bn_size=2, num_classes=5)

    def load_state_dict(self, state_dict, strict=True):
        # the checkpoints' old keys ('norm.1', 'conv.2'), as torchvision's _load_state_dict reads them
        pattern = re.compile(
            r'^(.*denselayer\\d+\\.(?:norm|relu|conv))\\.((?:[12])\\.(?:weight|bias|running_mean|running_var))$')
        for key in list(state_dict.keys()):
            res = pattern.match(key)
            if res:
                state_dict[res.group(1) + res.group(2)] = state_dict.pop(key)
        return super(ImageClassifier, self).load_state_dict(state_dict, strict)
'''

# A body naming a file: the handler creates it, then holds its batch (the stub is killed meanwhile)
SLOW_HANDLER = '''
import time
from pathlib import Path


def handle(data, context):
    if data is None:
        return None
    for row in data:
        if row.get("body", b"").startswith(b"/"):
            Path(row["body"].decode()).touch()
            time.sleep(60)
    return [{"ok": True} for _ in data]
'''


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """mnist.mar as TorchServe's MNIST README makes it (random weights), and tiny-densenet.mar whose state_dict has
    the old keys only its own load_state_dict reads."""
    folder = tmp_path_factory.mktemp("trust")
    store, src = folder / "model_store", folder / "src"
    store.mkdir()
    src.mkdir()
    torch.manual_seed(0)
    torch.save(import_model_class(MNIST / "mnist.py", None)().state_dict(), src / "mnist_cnn.pt")
    run_archiver("--model-name", "mnist", "--version", "1.0", "--model-file", str(MNIST / "mnist.py"),
                 "--serialized-file", str(src / "mnist_cnn.pt"), "--handler", str(MNIST / "mnist_handler.py"),
                 "--export-path", str(store))
    (src / "model.py").write_text(DENSENET)
    net = import_model_class(src / "model.py", None)()
    # as torchvision's old densenet161 checkpoint: 'norm.1' for 'norm1', and no num_batches_tracked
    state = {key.replace("norm1", "norm.1").replace("conv1", "conv.1").replace("norm2", "norm.2")
             .replace("conv2", "conv.2") if "denselayer" in key else key: value
             for key, value in net.state_dict().items() if not key.endswith("num_batches_tracked")}
    assert any("norm.1" in key for key in state)
    torch.save(state, src / "densenet.pth")
    (src / "index_to_name.json").write_text(json.dumps(LABELS))
    run_archiver("--model-name", "tiny-densenet", "--version", "1.0", "--model-file", str(src / "model.py"),
                 "--serialized-file", str(src / "densenet.pth"), "--handler", "image_classifier",
                 "--extra-files", str(src / "index_to_name.json"), "--export-path", str(store))
    (src / "slow_handler.py").write_text(SLOW_HANDLER)
    run_archiver("--model-name", "slow", "--version", "1.0", "--handler", str(src / "slow_handler.py"),
                 "--export-path", str(store))
    return store


@pytest.fixture(scope="module")
def web(store):
    """A web server of a copy of mnist.mar under another name: a registration by URL downloads it."""
    served = store.parent / "web"
    served.mkdir()
    shutil.copyfile(store / "mnist.mar", served / "mnist-downloaded.mar")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def reference(store) -> dict[str, tuple[int, bytes]]:
    """TorchServe 0.12 itself on the same store: one prediction from each archive."""
    folder = store.parent / "torchserve"
    with torchserve.started(folder, store / "mnist.mar", workers=1, properties={"enable_model_api": "true"}) as real:
        status, body = call("POST", f"{real.management_url}/models?url=tiny-densenet.mar&initial_workers=1"
                                    "&synchronous=true")
        assert status == 200, body
        return {"mnist": call("POST", f"{real.inference_url}/predictions/mnist", DIGIT.read_bytes()),
                "tiny-densenet": call("POST", f"{real.inference_url}/predictions/tiny-densenet", PHOTO.read_bytes())}


@pytest.fixture(scope="module")
def front(store):
    # no --trust-model-code: the store is the operator's, as under TorchServe
    started = TorchServeFront(store.parent / "front", "--log-file", str(store.parent / "triton.log"),
                              model_store=str(store), load_models="mnist.mar,tiny-densenet.mar",
                              enable_model_api="true", disable_token_authorization="true",
                              allowed_urls=r"http://127\.0\.0\.1:[0-9]+/.*")
    yield started
    started.stop()


def test_the_store_s_archives_run_their_code_without_the_flag_and_answer_as_torchserve(front, reference, store):
    assert not [line for line in front.lines if "could not load" in line or "trust-model-code: " in line], front.lines
    status, body = call("POST", f"{front.inference_url}/predictions/mnist", DIGIT.read_bytes())
    assert (status, body) == reference["mnist"]  # the custom handler's answer, byte for byte
    status, body = call("POST", f"{front.inference_url}/predictions/tiny-densenet", PHOTO.read_bytes())
    ours, theirs = json.loads(body), json.loads(reference["tiny-densenet"][1])
    assert status == 200 and reference["tiny-densenet"][0] == 200 and sorted(ours) == sorted(theirs), (ours, theirs)
    assert np.allclose([ours[k] for k in theirs], list(theirs.values()), rtol=0, atol=1e-5), (ours, theirs)
    assert "log " + str(store.parent / "triton.log") in front.ready_line  # --log-file honoured in this mode
    assert (store.parent / "triton.log").stat().st_size > 0


def test_an_archive_downloaded_from_an_allowed_url_runs_its_code_as_under_torchserve(front, reference, web, store):
    status, body = call("POST", f"{front.management_url}/models?url={web}/mnist-downloaded.mar&model_name=mnist_dl"
                                "&initial_workers=1&synchronous=true")
    assert status == 200, body
    assert call("POST", f"{front.inference_url}/predictions/mnist_dl", DIGIT.read_bytes()) == reference["mnist"]
    assert (store / "mnist-downloaded.mar").is_file()  # downloaded into the store, as TorchServe does


def test_a_model_whose_stub_died_with_a_batch_in_flight_is_unregistered_and_registered_again(front, store, tmp_path):
    """Triton 2.51 never ends the unload of a model one of whose stubs died with a batch in flight, even once its
    instances were replaced: DELETE answers once nothing of ours is in flight and it has been unloading 10 s (it
    waited the whole 120 s; TorchServe 0.12 answers at once, the same 200); the name registers again, as a new copy,
    and answers. The request in the batch gets TorchServe's answer for a worker that died."""
    from server.procfs import stubs_of

    registering = f"{front.management_url}/models?url=slow.mar&initial_workers=1&synchronous=true"
    assert call("POST", registering)[0] == 200
    inside = tmp_path / "in-the-batch"
    answers = []
    sending = threading.Thread(target=lambda: answers.append(
        call("POST", f"{front.inference_url}/predictions/slow", str(inside).encode())))
    sending.start()
    deadline = time.monotonic() + 120
    while not inside.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert inside.exists(), front.lines[-5:]
    stub = next(s for s in stubs_of(front.triton_pid) if s.model == "slow" and s.serves and s.alive)
    mark = len(front.lines)
    os.kill(stub.pid, signal.SIGKILL)
    sending.join(120)
    # TorchServe 0.12's answer, recorded on the same handler with its worker killed inside the batch
    assert answers == [(507, b'{\n  "code": 507,\n  "type": "InternalServerException",\n'
                             b'  "message": "Worker died."\n}\n')], answers
    front.wait_for("slow: ready again", 120, mark)
    assert call("POST", f"{front.inference_url}/predictions/slow", b"x") == (200, b'{\n  "ok": true\n}')
    assert call("DELETE", f"{front.management_url}/models/slow")[0] == 200
    assert front.seen("unloading slow: still unloading after 10 s (a stub that died with a batch in flight", mark)
    assert not front.seen("not unloaded after 120 s", mark), front.lines[mark:]
    assert call("POST", registering)[0] == 200
    assert call("POST", f"{front.inference_url}/predictions/slow", b"x") == (200, b'{\n  "ok": true\n}')
    again = len(front.lines)
    assert call("DELETE", f"{front.management_url}/models/slow")[0] == 200
    assert not front.seen("unloading slow", again), front.lines[again:]  # a healthy copy unloads in time
