"""TorchServe's gRPC APIs served by serve-repo: TorchServe's own Python gRPC client example run unchanged against the
front (its answer the REST answer), and every call's answer (gRPC status code and message) compared with TorchServe
0.12's own gRPC on the same archive, calls and tokens: this module's calls, then tests/grpc_table.py's rows (every
field of every request message at its edges), on one TorchServe and one front."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import empty_pb2

import grpc_table
from perf import torchserve
from perf.serve import TorchServeFront
from server.torchserve.proto import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from support import ROOT
from test_handler import _archive

NAME = "resnet-18"
KITTEN = ROOT / "tests" / "torchserve_examples" / "resnet_152_batch" / "images" / "kitten.jpg"
CLIENT = ROOT / "tests" / "torchserve_examples" / "ts_scripts" / "torchserve_grpc_client.py"
MAX_REQUEST = grpc_table.MAX_REQUEST
PROPERTIES = {"enable_model_api": "true", "max_request_size": str(MAX_REQUEST)}
# TorchServe's client example as its docs run it (its modules generated from the .proto files beside it, here ours),
# its fixed localhost:7070 / 7071 sent to the ports given: the script itself runs unchanged.
RUNNER = """import runpy, sys, grpc
from server.torchserve.proto import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
sys.modules.update(inference_pb2=inference_pb2, inference_pb2_grpc=inference_pb2_grpc,
                   management_pb2=management_pb2, management_pb2_grpc=management_pb2_grpc)
ports = {"localhost:7070": "127.0.0.1:" + sys.argv[1], "localhost:7071": "127.0.0.1:" + sys.argv[2]}
made = grpc.insecure_channel
grpc.insecure_channel = lambda target, *args, **kwargs: made(ports.get(target, target), *args, **kwargs)
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# what differs between two runs of the same server: pids, times, memory
VOLATILE = {"pid", "startTime", "memoryUsage", "id", "gpuUsage"}


class Endpoint:
    """One server's gRPC APIs with its tokens: each call's answer as (status code, message or details)."""

    def __init__(self, ports: tuple[int, int], keys: dict[str, str], rest: str):
        self.ports, self.keys, self.rest = ports, keys, rest
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        self.inference = inference_pb2_grpc.InferenceAPIsServiceStub(self.channels[0])
        self.management = management_pb2_grpc.ManagementAPIsServiceStub(self.channels[1])
        for channel in self.channels:  # TorchServe opens its gRPC ports after its REST ones answer
            grpc.channel_ready_future(channel).result(timeout=120)

    def metadata(self, api: str, token: str | None = "right") -> tuple:
        key = self.keys[api] if token == "right" else token
        return (("authorization", f"Bearer {key}"),) if key else ()

    def call(self, api: str, method: str, request, token: str | None = "right") -> tuple[str, str]:
        stub = self.inference if api == "inference" else self.management
        try:
            reply = getattr(stub, method)(request, metadata=self.metadata(api, token), timeout=300)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
        text = reply.health if api == "inference" and method == "Ping" else \
            reply.prediction.decode() if api == "inference" else reply.msg
        return "OK", text

    def raw(self, method: str, payload: bytes) -> tuple[str, str]:
        """Bytes that are no PredictionsRequest, sent as one."""
        call = self.channels[0].unary_unary(f"/org.pytorch.serve.grpc.inference.InferenceAPIsService/{method}")
        try:
            call(payload, metadata=self.metadata("inference"), timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
        return "OK", ""

    def client(self, *args: str) -> tuple[int, str]:
        # --auth-token=KEY, one argument: a key TorchServe generates may begin with "-" (argparse then exits 2)
        key = self.keys["management" if args[0].endswith("register") else "inference"]
        done = subprocess.run([sys.executable, "-c", RUNNER, *map(str, self.ports), str(CLIENT), *args,
                               f"--auth-token={key}"],
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        return done.returncode, done.stdout

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def predict(name: str, data: dict, version: str = "") -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name=name, model_version=version, input=data)


def exercise(end: Endpoint) -> dict:
    """The same calls, in the same order, on either server: TorchServe's client example, then every call."""
    answers, kitten = {}, KITTEN.read_bytes()
    answers["ping, no model"] = end.call("inference", "Ping", empty_pb2.Empty())
    answers["no token"] = end.call("management", "ListModels", management_pb2.ListModelsRequest(), token=None)
    answers["wrong token"] = end.call("inference", "Ping", empty_pb2.Empty(), token="wrong")
    answers["inference key for management"] = end.call("management", "ListModels", management_pb2.ListModelsRequest(),
                                                        token=end.keys["inference"])
    answers["register, no url"] = end.call("management", "RegisterModel", management_pb2.RegisterModelRequest())
    answers["register, missing archive"] = end.call("management", "RegisterModel",
                                                    management_pb2.RegisterModelRequest(url="missing.mar"))
    answers["client register"] = end.client("register", NAME, f"{NAME}.mar")
    answers["register twice"] = end.call("management", "RegisterModel",
                                         management_pb2.RegisterModelRequest(url=f"{NAME}.mar"))
    answers["ping"] = end.call("inference", "Ping", empty_pb2.Empty())
    answers["client infer"] = end.client("infer", NAME, str(KITTEN))
    answers["predictions"] = end.call("inference", "Predictions", predict(NAME, {"data": kitten}))
    request = urllib.request.Request(f"{end.rest}/predictions/{NAME}", data=kitten, method="POST", headers={
        "Authorization": f"Bearer {end.keys['inference']}", "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        answers["rest predictions"] = reply.read().decode()
    answers["unknown model"] = end.call("inference", "Predictions", predict("nope", {"data": kitten}))
    answers["unknown version"] = end.call("inference", "Predictions", predict(NAME, {"data": kitten}, "9.9"))
    answers["no model name"] = end.call("inference", "Predictions", predict("", {"data": kitten}))
    answers["empty input"] = end.call("inference", "Predictions", predict(NAME, {}))
    answers["not an image"] = end.call("inference", "Predictions", predict(NAME, {"data": b"hello"}))
    answers["over max_request_size"] = end.call("inference", "Predictions",
                                                predict(NAME, {"data": b"x" * (MAX_REQUEST + 100)}))
    answers["wrong proto"] = end.raw("Predictions", b"\x0a\xff\xff")
    answers["describe"] = end.call("management", "DescribeModel", management_pb2.DescribeModelRequest(model_name=NAME))
    answers["describe unknown"] = end.call("management", "DescribeModel",
                                           management_pb2.DescribeModelRequest(model_name="nope"))
    answers["describe unknown version"] = end.call("management", "DescribeModel", management_pb2.DescribeModelRequest(
        model_name=NAME, model_version="9.9"))
    answers["list"] = end.call("management", "ListModels", management_pb2.ListModelsRequest(limit=10))
    answers["list, no limit"] = end.call("management", "ListModels", management_pb2.ListModelsRequest())
    answers["scale"] = end.call("management", "ScaleWorker", management_pb2.ScaleWorkerRequest(
        model_name=NAME, min_worker=1, max_worker=1, synchronous=True))
    answers["scale, min over max"] = end.call("management", "ScaleWorker", management_pb2.ScaleWorkerRequest(
        model_name=NAME, min_worker=3, max_worker=2))
    answers["scale unknown"] = end.call("management", "ScaleWorker",
                                        management_pb2.ScaleWorkerRequest(model_name="nope", min_worker=1))
    answers["set default"] = end.call("management", "SetDefault",
                                      management_pb2.SetDefaultRequest(model_name=NAME, model_version="1.0"))
    answers["set default, unknown version"] = end.call("management", "SetDefault", management_pb2.SetDefaultRequest(
        model_name=NAME, model_version="9.9"))
    answers["set default, unknown model"] = end.call("management", "SetDefault", management_pb2.SetDefaultRequest(
        model_name="nope", model_version="1.0"))
    answers["unregister, no name"] = end.call("management", "UnregisterModel", management_pb2.UnregisterModelRequest())
    answers["client unregister"] = end.client("unregister", NAME)
    answers["unregister again"] = end.call("management", "UnregisterModel",
                                           management_pb2.UnregisterModelRequest(model_name=NAME))
    answers["list, none"] = end.call("management", "ListModels", management_pb2.ListModelsRequest())
    answers["table"] = grpc_table.replay(end, kitten)
    return answers


def _keys(folder: Path) -> dict[str, str]:
    return {api: value["key"] for api, value in json.loads((folder / "key_file.json").read_text()).items()}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grpc") / "model_store"
    torchserve.resnet_archive(folder, NAME, 8, 5, 1, arch="resnet18", fc_scale=0.01)
    grpc_table.add_archives(folder, _archive)
    return folder


def _theirs(store: Path) -> dict:
    """TorchServe 0.12 itself, tokens on, no model at first: its answers."""
    folder = store.parent / "torchserve"
    ports = [torchserve.free_port(), torchserve.free_port()]
    grpc_ports = {"grpc_inference_port": str(ports[0]), "grpc_management_port": str(ports[1])}
    with torchserve.started(folder, None, None, store=store, properties={**PROPERTIES, **grpc_ports},
                            token_auth=True) as real:
        end = Endpoint(tuple(ports), _keys(folder), real.inference_url)
        try:
            return exercise(end)
        finally:
            end.close()


def _ours(store: Path) -> dict:
    """serve-repo's TorchServe front, tokens on: the same calls' answers."""
    # two workers at most (serve-repo's bound; the table scales to 2), whatever this machine's CPU count
    front = TorchServeFront(store.parent / "front", model_store=str(store), max_workers_per_model="2", **PROPERTIES)
    try:
        end = Endpoint(tuple(front.grpc_ports), _keys(front.folder), front.inference_url)
        try:
            return exercise(end)
        finally:
            end.close()
    finally:
        front.stop()


@pytest.fixture(scope="module")
def answers(store) -> tuple[dict, dict]:
    """(ours, TorchServe's), the two replays side by side: each waits on its workers much of the time."""
    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(_theirs, store)
        return _ours(store), theirs.result()


@pytest.fixture(scope="module")
def reference(answers) -> dict:
    return answers[1]


@pytest.fixture(scope="module")
def ours(answers) -> dict:
    return answers[0]


def _top5(text: str) -> dict:
    answer = json.loads(text)
    assert isinstance(answer, dict) and len(answer) == 5, text
    return answer


def test_torchserve_grpc_client_example_runs_unchanged_when_served_by_the_front(ours, reference):
    for key in ("client register", "client infer", "client unregister"):
        assert ours[key][0] == 0 == reference[key][0], (key, ours[key], reference[key])
    assert ours["client register"] == reference["client register"]
    assert ours["client unregister"] == reference["client unregister"]
    printed = _top5(ours["client infer"][1])
    assert printed == json.loads(ours["rest predictions"])  # the same top 5 as REST /predictions
    assert ours["predictions"] == ("OK", ours["rest predictions"])  # byte for byte
    theirs = _top5(reference["client infer"][1])
    assert list(printed) == list(theirs)
    assert np.allclose(list(printed.values()), list(theirs.values()), rtol=0, atol=1e-5)


def _described(answer: tuple[str, str]) -> tuple:
    code, text = answer
    if code != "OK":
        return answer
    models = json.loads(text)
    for model in models:
        model["workers"] = [{k: v for k, v in w.items() if k not in VOLATILE} for w in model["workers"]]
    return code, models


SAME = ["ping, no model", "no token", "wrong token", "inference key for management", "register, no url",
        "register, missing archive", "register twice", "ping", "unknown model", "unknown version", "no model name",
        "empty input", "not an image", "over max_request_size", "wrong proto", "describe unknown",
        "describe unknown version", "list", "list, no limit", "scale", "scale, min over max", "scale unknown",
        "set default", "set default, unknown version", "set default, unknown model", "unregister, no name",
        "unregister again", "list, none"]


@pytest.mark.parametrize("call", SAME)
def test_grpc_answer_is_torchserves_when_the_same_call_is_made(ours, reference, call):
    assert ours[call] == reference[call]


def test_grpc_describe_is_torchserves_when_pids_and_times_are_left_out(ours, reference):
    (code, mine), (theirs_code, theirs) = _described(ours["describe"]), _described(reference["describe"])
    assert code == theirs_code == "OK" and len(mine) == len(theirs) == 1
    assert {key: (value, theirs[0].get(key)) for key, value in mine[0].items() if value != theirs[0].get(key)} == {}
    assert list(mine[0]) == list(theirs[0])


@pytest.mark.parametrize("module", [inference_pb2, management_pb2])
def test_generated_modules_hold_the_vendored_proto_s_messages_fields_and_calls_when_compared(module):
    """The committed *_pb2.py against the .proto beside it: every message's fields (name and number) and every call."""
    text = (ROOT / module.DESCRIPTOR.name).read_text()
    generated = {(message.name, field.name, field.number) for message in module.DESCRIPTOR.message_types_by_name.values()
                 for field in message.fields}
    declared, current = set(), None
    for line in text.splitlines():
        if found := re.match(r"\s*message (\w+)", line):
            current = found.group(1)
        elif found := re.match(r"\s*(?:optional |repeated )?[\w.<>, ]+? (\w+) = (\d+);", line):
            declared.add((current, found.group(1), int(found.group(2))))
    assert declared and declared == generated
    calls = set(re.findall(r"rpc (\w+)\(", text))
    (service,) = module.DESCRIPTOR.services_by_name.values()
    assert calls == {method.name for method in service.methods}


def test_grpc_table_covers_every_call_and_field_of_both_protos_when_read():
    assert len(grpc_table.ROWS) >= 150
    calls = {call for call, _, _ in grpc_table.ROWS}
    for module in (inference_pb2, management_pb2):
        (service,) = module.DESCRIPTOR.services_by_name.values()
        assert {method.name for method in service.methods} <= calls
    used = {(call, key) for call, fields, _ in grpc_table.ROWS for key in fields} | \
        {("StreamPredictions2", key) for call, fields, _ in grpc_table.ROWS for request in fields.get("requests", ())
         for key in request}
    for call, kind in grpc_table.MESSAGES.items():
        assert {(call, field.name) for field in kind.DESCRIPTOR.fields} <= used, call
    assert {("StreamPredictions2", field.name) for field in inference_pb2.PredictionsRequest.DESCRIPTOR.fields} <= used


def test_grpc_table_answers_as_torchserve_or_its_difference_is_listed(ours, reference):
    listed = (ROOT / "docs" / "migrating.md").read_text()
    found = []
    for row, mine, theirs in zip(grpc_table.ROWS, ours["table"], reference["table"]):
        call, fields, compare = row
        if compare.startswith("differs: "):
            assert compare.removeprefix("differs: ") in listed, row
        if (why := grpc_table.different(compare, mine, theirs)) is not None:
            shown = {key: (value if len(str(value)) < 80 else f"{str(value)[:60]}...") for key, value in fields.items()}
            found.append(f"{call} {shown}: {why}\n  ours:   {str(mine)[:400]}\n  theirs: {str(theirs)[:400]}")
    assert not found, f"{len(found)} differences:\n" + "\n".join(found)
