"""TorchServe 0.12's own Python worker, in-process, as the reference for a served handler's answers.

`python -m tests.ts_reference ARCHIVE FILE...` unpacks the archive, loads it with ts's TsModelLoader as
TorchServe's model_service_worker does (in the model's folder, that folder on sys.path), and sends each file as
one request through ts's Service.predict, one at a time; it prints one JSON object per file: the HTTP code,
content type and payload (base64) decoded from the worker's own reply message (ts/protocol/otf_message_handler).
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import struct
import sys
import tempfile
import zipfile


def _reply(message: bytes) -> dict:
    """create_predict_response's bytes for one request -> code, content type, payload."""
    offset = 0

    def integer() -> int:
        nonlocal offset
        value = struct.unpack_from("!i", message, offset)[0]
        offset += 4
        return value

    def chunk() -> bytes:
        nonlocal offset
        size = integer()
        value = message[offset:offset + size]
        offset += size
        return bytes(value)

    batch_code, _batch_message, _request_id, content_type = integer(), chunk(), chunk(), chunk()
    code, _phrase = integer(), chunk()
    for _ in range(integer()):  # response headers
        chunk(), chunk()
    payload = chunk()
    return {"code": code if batch_code == 200 else batch_code, "content_type": content_type.decode(),
            "payload": base64.b64encode(payload).decode()}


def main(argv: list[str]) -> int:
    archive, files = os.path.abspath(argv[0]), [os.path.abspath(path) for path in argv[1:]]
    folder = tempfile.mkdtemp(prefix="ts-reference-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the unpacked archive (~230 MB for a ResNet)
    with zipfile.ZipFile(archive) as bundle:
        bundle.extractall(folder)
    with open(os.path.join(folder, "MAR-INF", "MANIFEST.json"), encoding="utf-8") as file:
        model = json.load(file)["model"]
    sys.path.insert(0, folder)
    os.chdir(folder)
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import TsModelLoader

    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    service = TsModelLoader().load(model["modelName"], folder, model["handler"], None, 1, None, True, metrics)
    service.set_cl_socket(None)  # the worker sets its socket to the frontend; answers here come back by return
    for index, path in enumerate(files):
        with open(path, "rb") as file:
            body = file.read()
        request = {"requestId": f"r{index}".encode(), "headers": [],
                   "parameters": [{"name": "body", "value": body, "contentType": ""}]}
        print(json.dumps(_reply(service.predict([request]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
