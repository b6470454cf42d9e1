"""Issue 42 B9: the handler path (a TorchServe archive's own handler in Triton's stub) bounds each request as the
image path does, on a real tritonserver: an image over `max_pixels` or JSON nested past the parser is refused alone,
before the handler sees it, and the requests batched with it are answered."""
from __future__ import annotations

import base64
import io
import json
import warnings

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from backends import ts_worker
from common import decoding
from common.modelconfig import read_config, to_text
from test_handler import _archive, _build

# Decodes what it is sent as TorchServe's vision handlers do (Image.open on the body, or a base64 "image" in JSON),
# answers its size, its first pixel (small images only) and the batch handle() saw.
IMAGE_HANDLER = '''
import base64
import io

from PIL import Image


def handle(data, context):
    if data is None:
        return None
    answers = []
    for row in data:
        body = row.get("body")
        if isinstance(body, dict):
            if "image" not in body:
                answers.append({"json": body, "batch": len(data)})
                continue
            body = base64.b64decode(body["image"])
        with Image.open(io.BytesIO(body)) as image:
            image.load()
            answers.append({"size": list(image.size), "pixel": list(image.convert("RGB").getpixel((0, 0))),
                            "batch": len(data)})
    return answers
'''
BOUND = 1_000_000  # the model's max_pixels in these tests: bombs of a few MB cost nothing to send or to refuse
JSON_TYPE = {"Content-Type": "application/json"}


def _png(size: tuple[int, int], mode: str = "RGB", color=(10, 200, 30)) -> bytes:
    buffer = io.BytesIO()
    if mode == "I;16":  # 16-bit grayscale, as in the bomb
        Image.fromarray(np.full((size[1], size[0]), 40000, dtype=np.uint16)).save(buffer, format="PNG")
    else:
        Image.new(mode, size, color if mode == "RGB" else 0).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """The image handler's model, batching up to 8 requests for up to 1 s (8 sent at once share one batch), its
    max_pixels BOUND."""
    folder = tmp_path_factory.mktemp("bounds")
    archive = _archive(folder, "imgsize", IMAGE_HANDLER, config="batchSize: 8\nmaxBatchDelay: 1000\n")
    repo = folder / "repo"
    _build(archive, repo, "--engine", "torch")
    config = read_config(repo / "imgsize")
    config.parameters["max_pixels"].string_value = str(BOUND)
    (repo / "imgsize" / "config.pbtxt").write_text(to_text(config))
    return repo


def _send(client, body: bytes, headers: dict | None = None):
    data = httpclient.InferInput("BODY", [1, 1], "BYTES")
    data.set_data_from_numpy(np.array([[body]], dtype=np.object_))
    return client.async_infer("imgsize", [data], parameters=headers)  # Triton hands them to the stub as parameters


def _outcome(pending) -> dict | str:
    """The handler's answer (JSON), or the error's message."""
    try:
        return json.loads(pending.get_result().as_numpy("RESPONSE")[0][0])
    except InferenceServerException as exc:
        return str(exc)


def test_request_item_refuses_a_bomb_and_deep_json_alone_in_the_image_paths_words_when_prepared(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    with warnings.catch_warnings():  # bound_images' filter, this test's only
        ts_worker.bound_images(BOUND)
        bomb = _png((2000, 1000), "I;16")
        with pytest.raises(ts_worker.Refused) as refused:
            ts_worker.request_item(bomb, {})
        with pytest.raises(decoding.ImageError) as plain:  # the plain front's decode, the same bound
            decoding.open_checked(bomb)
        assert refused.value.status == 413 and refused.value.reason == str(plain.value)
        assert refused.value.reason == ("decompression bomb refused: the header claims 2,000,000 pixels, more than "
                                        "max_pixels 1,000,000")
        huge = _png((3000, 1000), "1")  # past twice the bound: PIL's own error, not its warning
        with pytest.raises(ts_worker.Refused, match="claims 3,000,000 pixels"):
            ts_worker.request_item(huge, {})
        with pytest.raises(ts_worker.Refused) as deep:
            ts_worker.request_item(b"[" * 5000 + b"]" * 5000, {"Content-Type": "application/json"})
        assert deep.value.status == 400 and str(deep.value) == "JSON nested too deeply to parse (400)"
        assert ts_worker.request_item(b"[[1]]", {"Content-Type": "application/json"})[0]["data"] == [[1]]
        assert ts_worker.request_item(b"{not json", {"Content-Type": "application/json"})[0]["data"] == b"{not json"
        small = _png((1000, 1000))  # at the bound: the handler's
        assert ts_worker.request_item(small, {})[0]["body"] == small
    assert ts_worker.DEFAULT_MAX_PIXELS == decoding.DEFAULT_MAX_PIXELS


def test_a_bomb_and_deep_json_are_refused_alone_and_their_batch_answered_when_sent_together(repository,
                                                                                            start_server):
    server = start_server(repository)
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    shared = False
    for _ in range(5):  # until one batch held both refused requests and the six others (1 s of batching: the first)
        pending = [_send(client, _png((2000, 1000), "I;16")),
                   _send(client, b"[" * 5000 + b"]" * 5000, JSON_TYPE)]
        pending += [_send(client, _png((32 + i, 16), color=(i, 2 * i, 3 * i))) for i in range(3)]
        pending += [_send(client, json.dumps({"values": [i]}).encode(), JSON_TYPE) for i in range(3)]
        bomb, deep, *honest = [_outcome(p) for p in pending]
        assert "decompression bomb refused: the header claims 2,000,000 pixels, more than max_pixels 1,000,000 " \
               "(413)" in bomb, bomb
        assert "JSON nested too deeply to parse (400)" in deep, deep
        assert [(a["size"], a["pixel"]) for a in honest[:3]] == [([32 + i, 16], [i, 2 * i, 3 * i]) for i in range(3)]
        assert [a["json"] for a in honest[3:]] == [{"values": [i]} for i in range(3)]
        if all(a["batch"] == 6 for a in honest):
            shared = True
            break
    assert shared, "the eight requests never reached the model as one batch"
    assert server.model_ready("imgsize")


def test_a_handlers_own_decode_refuses_past_max_pixels_when_the_image_comes_in_json(repository, start_server):
    """An image our code cannot see (base64 inside JSON) meets the same bound in the handler's own Image.open: PIL's
    warning between the bound and twice it is an error in the stub (a failure of handle(), as TorchServe's)."""
    server = start_server(repository)
    client = httpclient.InferenceServerClient(server.http_url)
    sent = json.dumps({"image": base64.b64encode(_png((1500, 1000), "1")).decode()}).encode()
    assert "DecompressionBomb" in _outcome(_send(client, sent, JSON_TYPE))
    small = json.dumps({"image": base64.b64encode(_png((1000, 1000))).decode()}).encode()
    assert _outcome(_send(client, small, JSON_TYPE))["size"] == [1000, 1000]
