"""Fuzz the proxy: shape / datatype / length mutations of honest inference requests, over HTTP JSON, HTTP binary,
gRPC unary and gRPC streaming, sent through serve-repo's proxy to a real tritonserver. What must hold: tritonserver
never restarts, every request gets an answer (an HTTP status, a gRPC status or stream response), and the honest
requests sent among them are answered correctly (HTTP and unary gRPC: the proxy refuses the streaming method).

    python -m drills.fuzz --requests 10000 --out drills/results/fuzz-resnet18.json

The repository: a model with a small input ("echo": X FP32 [-1, 4] -> Y, the first values back), so that honest
JSON requests exist at all (a 224x224 image in JSON is over the 64 KB the guard reads), beside resnet18's tensor
and image models. tests/test_proxy.py runs a few hundred of the same mutations."""
from __future__ import annotations

import http.client
import json
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common.cli import OneLineParser, write_result

ECHO = "echo"
ECHO_MODEL = Path(__file__).resolve().parent.parent / "perf" / "gpu" / "echo_model.py"
WIDTH = 4
IMAGE = "IMAGE"
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES", "FP33", "", "fp32"]
DIMS = [0, 1, 2, 3, 4, 5, 8, 9, 224, -1, -4, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1,
        10 ** 20]
JSON_DIMS = DIMS + [1.5, 4.0, 1e3, "4", None, True, [4], -0.0]


def write_echo(repository: Path, max_batch: int = 8) -> None:
    """perf/gpu/echo_model.py as ECHO: X FP32 [WIDTH] -> Y FP32 [WIDTH] (its input back), batched, one CPU instance."""
    from tritonclient.grpc import model_config_pb2 as mc
    from google.protobuf import text_format

    config = mc.ModelConfig(name=ECHO, backend="python", max_batch_size=max_batch)
    config.input.add(name="X", data_type=mc.TYPE_FP32, dims=[WIDTH])
    config.output.add(name="Y", data_type=mc.TYPE_FP32, dims=[WIDTH])
    config.dynamic_batching.SetInParent()
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repository / ECHO / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(ECHO_MODEL, repository / ECHO / "1" / "model.py")
    (repository / ECHO / "config.pbtxt").write_text(text_format.MessageToString(config))


# ---------------------------------------------------------------------------------------------------------------
# Requests: (protocol, payload, expected) where expected is the echo's answer for an honest one, else None.

def _values(rng: random.Random, batch: int) -> np.ndarray:
    return np.array([[rng.uniform(-8, 8) for _ in range(WIDTH)] for _ in range(batch)], dtype=np.float32)


def _json_request(inputs: list[dict]) -> bytes:
    return json.dumps({"inputs": inputs}).encode()


def _mutate_shape(rng: random.Random, shape: list, pool: list) -> list:
    shape = list(shape)
    what = rng.random()
    if what < 0.6 and shape:
        shape[rng.randrange(len(shape))] = rng.choice(pool)
    elif what < 0.75 and shape:
        del shape[rng.randrange(len(shape))]
    elif what < 0.9:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice(pool))
    else:
        shape = [rng.choice(pool) for _ in range(rng.randrange(0, 5))]
    return shape


def _mutate_declared(rng: random.Random, tensor: dict, kind: int, pool: list) -> None:
    """Kinds 0 and 1, the same on every protocol: a shape mutated with dims from `pool`, or another datatype."""
    if kind == 0:
        tensor["shape"] = _mutate_shape(rng, tensor["shape"], pool)
    elif kind == 1:
        tensor["datatype"] = rng.choice(DATATYPES)


def _corrupt(rng: random.Random, data: bytes) -> bytes:
    """`data` cut short, or with one byte replaced."""
    cut = rng.randrange(1, len(data))
    return data[:cut] if rng.random() < 0.5 else data[:cut] + bytes([rng.randrange(256)]) + data[cut + 1:]


def http_json(rng: random.Random, honest: bool) -> tuple[str, dict, bytes, np.ndarray | None]:
    batch = rng.randint(1, 8)
    values = _values(rng, batch)
    tensor = {"name": "X", "shape": [batch, WIDTH], "datatype": "FP32", "data": values.flatten().tolist()}
    if honest:
        return f"/v2/models/{ECHO}/infer", {}, _json_request([tensor]), values
    kind = rng.randrange(8)
    _mutate_declared(rng, tensor, kind, JSON_DIMS)
    if kind == 2:
        tensor["data"] = tensor["data"][: rng.randrange(len(tensor["data"]))] + [rng.choice([1, "x", None, [1]])] * rng.randrange(3)
    elif kind == 3:
        tensor["name"] = rng.choice(["Y", "", "X\u0000", "IMAGE", "x" * 300])
    elif kind == 4:
        return f"/v2/models/{ECHO}/infer", {}, _json_request([tensor, dict(tensor)]), None
    elif kind == 5:
        tensor["parameters"] = {rng.choice(["shared_memory_region", "binary_data_size", "x"]): rng.choice(DIMS)}
    elif kind == 6:  # the request and its kin: a zero dim beside a wrapping one, little data
        tensor = {"name": rng.choice(["X", IMAGE]), "shape": [0, rng.choice(DIMS)], "datatype": "FP32", "data": []}
    body = _json_request([tensor])
    if kind == 7:  # bytes: truncated, or one flipped
        body = _corrupt(rng, body)
    model = rng.choice([ECHO, ECHO, ECHO, "resnet18", "nosuch"])
    return f"/v2/models/{model}/infer", {}, body, None


def http_binary(rng: random.Random, honest: bool) -> tuple[str, dict, bytes, np.ndarray | None]:
    batch = rng.randint(1, 8)
    values = _values(rng, batch)
    raw = values.tobytes()
    tensor = {"name": "X", "shape": [batch, WIDTH], "datatype": "FP32", "parameters": {"binary_data_size": len(raw)}}
    header_length = None
    if not honest:
        kind = rng.randrange(6)
        _mutate_declared(rng, tensor, kind, DIMS)
        if kind == 2:
            tensor["parameters"]["binary_data_size"] = rng.choice([0, len(raw) - 1, len(raw) + 1, -1, 2 ** 63, 1.5])
        elif kind == 3:
            raw = raw[: rng.randrange(len(raw))] if rng.random() < 0.5 else raw + b"\0" * rng.randint(1, 64)
        elif kind == 4:
            header_length = rng.choice([0, 1, -1, 10 ** 9, "x"])
        elif kind == 5:
            tensor["shape"] = [rng.choice(DIMS), rng.choice(DIMS)]
            tensor["parameters"]["binary_data_size"] = rng.choice([0, 4, 16])
            raw = raw[: tensor["parameters"]["binary_data_size"]]
    header = _json_request([tensor])
    headers = {"Inference-Header-Content-Length": str(len(header) if header_length is None else header_length)}
    return f"/v2/models/{ECHO}/infer", headers, header + raw, values if honest else None


def _grpc_request(rng: random.Random, honest: bool):
    from tritonclient.grpc import service_pb2 as pb

    batch = rng.randint(1, 8)
    values = _values(rng, batch)
    request = pb.ModelInferRequest(model_name=ECHO)
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[batch, WIDTH])
    request.raw_input_contents.append(values.tobytes())
    if honest:
        return request.SerializeToString(), values
    kind = rng.randrange(8)
    if kind == 0:
        del tensor.shape[:]
        tensor.shape.extend([d if d < 2 ** 63 else d - 2 ** 64 for d in _mutate_shape(rng, [batch, WIDTH], DIMS)
                             if -2 ** 63 <= d < 2 ** 64])
    elif kind == 1:
        tensor.datatype = rng.choice(DATATYPES)
    elif kind == 2:
        request.raw_input_contents[0] = request.raw_input_contents[0][: rng.randrange(batch * WIDTH * 4)]
    elif kind == 3:
        request.raw_input_contents.append(b"\0" * rng.randrange(64))
    elif kind == 4:
        del request.raw_input_contents[:]
        tensor.contents.fp32_contents.extend(values.flatten().tolist()[: rng.randrange(batch * WIDTH + 2)])
    elif kind == 5:
        tensor.name = rng.choice(["Y", "", IMAGE])
        request.model_name = rng.choice([ECHO, "resnet18", "nosuch", ""])
    elif kind == 6:
        tensor.parameters["shared_memory_region"].string_param = "region"
    data = request.SerializeToString()
    if kind == 7:
        data = _corrupt(rng, data)
    return data, None


# ---------------------------------------------------------------------------------------------------------------
# Sending.

class Outcome:
    def __init__(self):
        self.lock = threading.Lock()
        self.sent = self.answered = self.honest = self.honest_right = 0
        self.unanswered: list[str] = []
        self.wrong: list[str] = []
        self.statuses: dict[str, int] = {}
        self.rules: dict[str, int] = {}

    def record(self, protocol: str, status: str | None, message: str, expected, answer) -> None:
        with self.lock:
            self.sent += 1
            if status is None:
                if len(self.unanswered) < 20:
                    self.unanswered.append(f"{protocol}: {message[:160]}")
                return
            self.answered += 1
            key = f"{protocol} {status}"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if "proxy rule " in message:
                rule = message.split("proxy rule ", 1)[1].split(":")[0]
                self.rules[rule] = self.rules.get(rule, 0) + 1
            if expected is not None:
                self.honest += 1
                if answer is not None and answer.shape == expected.shape and np.array_equal(answer, expected):
                    self.honest_right += 1
                elif len(self.wrong) < 20:
                    self.wrong.append(f"{protocol} {status}: {message[:160]}")


def _send_http(host: str, port: int, rng: random.Random, count: int, outcome: Outcome, honest_share: float) -> None:
    connection = http.client.HTTPConnection(host, port, timeout=60)
    for _ in range(count):
        honest = rng.random() < honest_share
        protocol = "http-json" if rng.random() < 0.5 else "http-binary"
        path, headers, body, expected = (http_json if protocol == "http-json" else http_binary)(rng, honest)
        try:
            connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
            reply = connection.getresponse()
            text = reply.read()
            answer = None
            if reply.status == 200 and expected is not None:
                answer = _http_answer(text, reply.getheader("Inference-Header-Content-Length"), len(expected))
            outcome.record(protocol, str(reply.status), text[:300].decode(errors="replace"), expected, answer)
            if reply.getheader("connection", "").lower() == "close":
                connection.close()
        except (OSError, http.client.HTTPException) as error:
            outcome.record(protocol, None, repr(error), expected, None)
            connection.close()
            connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.close()


def _http_answer(body: bytes, header_length: str | None, batch: int) -> np.ndarray | None:
    length = int(header_length) if header_length else len(body)
    output = json.loads(body[:length])["outputs"][0]
    if "data" in output:
        return np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    return np.frombuffer(body[length:], dtype=np.float32).reshape(output["shape"])


def _grpc_answer(response, batch: int) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(list(response.outputs[0].shape))


def _send_grpc(target: str, rng: random.Random, count: int, outcome: Outcome, honest_share: float,
               stream_size: int = 16) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
    unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b,
                                response_deserializer=pb.ModelInferResponse.FromString)
    streaming = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                      request_serializer=lambda b: b,
                                      response_deserializer=pb.ModelStreamInferResponse.FromString)
    sent = 0
    while sent < count:
        if rng.random() >= 1 / (1 + stream_size):  # as many messages on streams as unary requests
            data, expected = _grpc_request(rng, rng.random() < honest_share)
            try:
                response = unary(data, timeout=60)
                outcome.record("grpc", "OK", "", expected, _grpc_answer(response, 0) if expected is not None else None)
            except grpc.RpcError as error:
                code = error.code()
                answered = code not in (grpc.StatusCode.DEADLINE_EXCEEDED,) and "Socket closed" not in str(error.details())
                outcome.record("grpc", code.name if answered else None, str(error.details()), expected, None)
            sent += 1
            continue
        # A stream's mutated messages: the proxy refuses the streaming method whole (it cannot check a stream's
        # messages one by one), so each is answered by the stream's end. (Straight to Triton, a message that does
        # not parse ends its stream too: gRPC's own rule.)
        honest = False
        batch = [_grpc_request(rng, honest) for _ in range(min(stream_size, count - sent))]
        sent += len(batch)
        responses, ending = [], "OK"
        try:
            for response in streaming(iter([data for data, _ in batch]), timeout=60):
                responses.append(response)
        except grpc.RpcError as error:
            ending = f"{error.code().name}: {error.details()}"
        # Triton answers a stream's messages in order, one response each (a non-decoupled model).
        for index, (_, expected) in enumerate(batch):
            if index >= len(responses):
                status = "ended " + ending.split(":")[0]
                outcome.record("grpc-stream", status, ending, expected, None)
                continue
            response = responses[index]
            if response.error_message:
                outcome.record("grpc-stream", "error", response.error_message, expected, None)
            else:
                answer = _grpc_answer(response.infer_response, 0) if expected is not None else None
                outcome.record("grpc-stream", "OK", "", expected, answer)
    channel.close()


def run(http_target: tuple[str, int], grpc_target: str, requests: int, seed: int = 0,
        honest_share: float = 0.1) -> Outcome:
    """`requests` requests (half HTTP, half gRPC, unary and streams), each thread its own seeded generator."""
    outcome = Outcome()
    threads = [threading.Thread(target=_send_http, args=(*http_target, random.Random(seed), requests // 2, outcome,
                                                          honest_share)),
               threading.Thread(target=_send_grpc, args=(grpc_target, random.Random(seed + 1),
                                                         requests - requests // 2, outcome, honest_share))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000, help="Default: 10000.")
    p.add_argument("--seed", type=int, default=0, help="Default: 0.")
    p.add_argument("--out", type=Path, help="JSON to write. Default: print only.")
    args = p.parse_args(argv)
    from perf.serve import ServeRepo
    from perf.bench import machine
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import build

    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        repository = Path(tmp) / "repo"
        build(repository, "--max-batch-size", "8", "--max-queue-delay-us", "2000")
        write_echo(repository)
        serve = ServeRepo(repository, "--proxy", "on")
        try:
            pid = serve.triton_pid
            started = time.monotonic()
            outcome = run(("127.0.0.1", serve.ports[0]), f"127.0.0.1:{serve.ports[1]}", args.requests, args.seed)
            seconds = time.monotonic() - started
            restarts = sum("tritonserver died" in line for line in serve.lines)
            proxy_restarts = sum("the proxy died" in line for line in serve.lines)
            same = serve.triton_pid == pid
        finally:
            serve.stop()
    result = {"machine": machine(), "requests": outcome.sent, "answered": outcome.answered,
              "unanswered_examples": outcome.unanswered, "honest": outcome.honest,
              "honest_answered_correctly": outcome.honest_right, "honest_wrong_examples": outcome.wrong,
              "tritonserver_restarts": restarts, "tritonserver_same_process": same, "proxy_restarts": proxy_restarts,
              "statuses": dict(sorted(outcome.statuses.items())), "proxy_rules": dict(sorted(outcome.rules.items())),
              "seconds": round(seconds, 1), "seed": args.seed}
    print(write_result(result, args.out))
    ok = (restarts == proxy_restarts == 0 and same and outcome.answered == outcome.sent and outcome.honest_right == outcome.honest)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
