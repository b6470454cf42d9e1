"""A TorchServe handler served unchanged (build-repo --from-mar --trust-model-code), on a real tritonserver.

Archives are made with torch-model-archiver from handlers written here; the reference is the same handler run
in-process with TorchServe 0.12's own Context.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from builder import cli as build_repo
from common.modelconfig import read_config
from examples.migrate_torchserve import run_archiver
from server.errors import ServerError

# JSON in, JSON out: the sum of "values" times the archive's scale.json, and the batch handle() saw.
JSON_HANDLER = '''
import json
import os

from ts.torch_handler.base_handler import BaseHandler


class JsonSum(BaseHandler):
    def initialize(self, context):
        with open(os.path.join(context.system_properties["model_dir"], "scale.json")) as file:
            self.scale = json.load(file)["scale"]
        self.initialized = True

    def preprocess(self, data):
        rows = [row.get("data") or row.get("body") for row in data]
        return [json.loads(row) if isinstance(row, (bytes, bytearray)) else row for row in rows]

    def inference(self, rows):
        for row in rows:
            if row.get("fail"):
                raise ValueError("asked to fail by " + str(row["values"]))
        return [{"sum": sum(row["values"]) * self.scale, "batch": len(rows)} for row in rows]

    def postprocess(self, answers):
        return answers
'''
# A handle function that returns text with its own content type.
TEXT_HANDLER = '''
def handle(data, context):
    if data is None:
        return None
    for index in range(len(data)):
        context.set_response_content_type(index, "text/plain; charset=utf-8")
    return [bytes(row.get("body")).decode("utf-8").upper() for row in data]
'''
FEWER_HANDLER = '''
def handle(data, context):
    return None if data is None else [{"ok": True}] * (len(data) - 1)
'''
BAD_INIT_HANDLER = '''
from ts.torch_handler.base_handler import BaseHandler


class BadInit(BaseHandler):
    def initialize(self, context):
        raise RuntimeError("weights file no_such.pt is missing")
'''
BATCHING = "batchSize: 8\nmaxBatchDelay: 200\n"


def _archive(folder: Path, name: str, handler_code: str, extra: dict[str, str] | None = None,
             config: str | None = None, requirements: str | None = None) -> Path:
    """A .mar made by torch-model-archiver from a handler file (and extra files), as a TorchServe user has it."""
    src = folder / f"{name}-src"
    src.mkdir(parents=True)
    (src / f"{name}_handler.py").write_text(handler_code)
    argv = ["--model-name", name, "--version", "1.0", "--handler", str(src / f"{name}_handler.py"),
            "--export-path", str(folder), "--force"]
    for file, text in (extra or {}).items():
        (src / file).write_text(text)
    if extra:
        argv += ["--extra-files", ",".join(str(src / file) for file in extra)]
    if config is not None:
        (src / "model-config.yaml").write_text(config)
        argv += ["--config-file", str(src / "model-config.yaml")]
    if requirements is not None:
        (src / "requirements.txt").write_text(requirements)
        argv += ["--requirements-file", str(src / "requirements.txt")]
    run_archiver(*argv)
    return folder / f"{name}.mar"


def _build(archive: Path, output: Path, *flags: str) -> None:
    assert build_repo.main(["--from-mar", str(archive), "--output", str(output), "--kind", "cpu",
                            "--trust-model-code", *flags]) == 0


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    folder = tmp_path_factory.mktemp("handler-archives")
    return {"jsonsum": _archive(folder, "jsonsum", JSON_HANDLER, {"scale.json": '{"scale": 3}'}, BATCHING),
            "text": _archive(folder, "text", TEXT_HANDLER),
            "fewer": _archive(folder, "fewer", FEWER_HANDLER),
            "badinit": _archive(folder, "badinit", BAD_INIT_HANDLER)}


@pytest.fixture(scope="module")
def repository(made, tmp_path_factory):
    """The three models that load; badinit is built into it by the test that loads it."""
    repo = tmp_path_factory.mktemp("handler-repo") / "repo"
    for name in ("jsonsum", "text", "fewer"):
        _build(made[name], repo)
    return repo


def _infer(client, model: str, body: bytes) -> tuple[bytes, str]:
    data = httpclient.InferInput("BODY", [1, 1], "BYTES")
    data.set_data_from_numpy(np.array([[body]], dtype=np.object_))
    result = client.infer(model, [data])
    return result.as_numpy("RESPONSE")[0][0], result.as_numpy("CONTENT_TYPE")[0][0].decode()


def _linear_state() -> dict:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).state_dict()


def _in_process(folder: Path, name: str, bodies: list[bytes]) -> list:
    """The handler run as TorchServe's worker runs it, one request per call: ts's own Context."""
    import ts
    from ts.context import Context, RequestProcessor
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    source = folder / f"{name}-src"
    spec = importlib.util.spec_from_file_location(f"ref_{name}", source / f"{name}_handler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    context = Context(name, str(source), {"model": {"modelName": name}}, 8, None, ts.__version__, True, metrics, {})
    handler = module.JsonSum()
    handler.initialize(context)
    answers = []
    for body in bodies:
        context.request_processor = [RequestProcessor({})]
        answers += handler.handle([{"data": body, "body": body}], context)
    return answers


def test_build_repo_writes_the_handler_model_when_the_archive_has_a_custom_handler(made, tmp_path, capsys):
    repo = tmp_path / "repo"
    archive = _archive(tmp_path, "reqs", FEWER_HANDLER, config="batchSize: 4\nmaxBatchDelay: 7\nminWorkers: 2\n",
                       requirements="numpy\n# a comment\nscipy==1.0\n")
    _build(archive, repo)
    out = capsys.readouterr().out
    assert "requirements.txt lists 2 package(s) (numpy, scipy==1.0): not installed" in out
    config = read_config(repo / "reqs")
    assert (config.backend, config.max_batch_size, config.dynamic_batching.max_queue_delay_microseconds) == \
        ("python", 4, 7000)
    assert [(t.name, t.dims) for t in config.input] == [("BODY", [1])]
    assert [(t.name, t.dims) for t in config.output] == [("RESPONSE", [1]), ("CONTENT_TYPE", [1]), ("STATUS", [1])]
    assert sum(group.count for group in config.instance_group) == 2
    version = repo / "reqs" / "1"
    assert (version / "archive" / "MAR-INF" / "MANIFEST.json").is_file()
    assert (version / "archive" / "reqs_handler.py").read_text() == FEWER_HANDLER
    assert {p.name for p in version.glob("*.py")} == {"model.py", "ts_worker.py", "ts_engine.py", "contract.py"}
    _build(archive, repo, "--force", "--max-batch-size", "16", "--max-batch-delay-ms", "2")
    config = read_config(repo / "reqs")
    assert (config.max_batch_size, config.dynamic_batching.max_queue_delay_microseconds) == (16, 2000)


def test_build_repo_refuses_the_handler_path_in_one_line_when_code_is_not_trusted(made, tmp_path, capsys):
    status = build_repo.main(["--from-mar", str(made["jsonsum"]), "--output", str(tmp_path / "repo")])
    err = capsys.readouterr().err.strip()
    assert status != 0 and len(err.splitlines()) == 1 and "--trust-model-code" in err, err
    assert not (tmp_path / "repo" / "jsonsum").exists()


def test_served_answers_equal_the_handler_in_process_when_sent_one_at_a_time(made, repository, start_server):
    server = start_server(repository)
    bodies = [json.dumps({"values": values}).encode() for values in ([1, 2, 3], [0.5], [], [-4, 10])]
    client = httpclient.InferenceServerClient(server.http_url)
    served = [_infer(client, "jsonsum", body) for body in bodies]
    expected = _in_process(made["jsonsum"].parent, "jsonsum", bodies)
    assert [payload for payload, _ in served] == [json.dumps(answer, indent=2).encode() for answer in expected]
    # no content type unless the handler set one: TorchServe's frontend then sends none (RestJob.responseInference)
    assert {content_type for _, content_type in served} == {""}
    assert _infer(client, "text", b"hello") == (b"HELLO", "text/plain; charset=utf-8")


def _together(server, model: str, parameters: list[dict]) -> list[dict]:
    """Request i ({"values": [i]}, with parameters[i]) sent at once, each answer's JSON in order."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=len(parameters))
    pending = []
    for index, extra in enumerate(parameters):
        data = httpclient.InferInput("BODY", [1, 1], "BYTES")
        data.set_data_from_numpy(np.array([[json.dumps({"values": [index]}).encode()]], dtype=np.object_))
        pending.append(client.async_infer(model, [data], parameters=extra or None))
    return [json.loads(p.get_result().as_numpy("RESPONSE")[0][0]) for p in pending]


def test_concurrent_requests_reach_handle_as_one_list_when_sent_together(repository, start_server):
    server = start_server(repository)
    answers = _together(server, "jsonsum", [{} for _ in range(8)])
    assert [answer["sum"] for answer in answers] == [3 * index for index in range(8)]  # each its own answer
    assert max(answer["batch"] for answer in answers) > 1, answers


def test_faults_stay_in_their_batch_when_a_handler_raises_or_miscounts(made, repository, start_server):
    server = start_server(repository, model_control="explicit")
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match=r"Prediction failed.*asked to fail by \[7\]"):
        _infer(client, "jsonsum", json.dumps({"values": [7], "fail": True}).encode())
    assert json.loads(_infer(client, "jsonsum", b'{"values": [2]}')[0])["sum"] == 6  # the next batch answers
    with pytest.raises(InferenceServerException, match="number of batch response mismatched"):
        _infer(client, "fewer", b"{}")
    assert server.ready() and server.model_ready("fewer") and server.model_ready("jsonsum")

    _build(made["badinit"], repository)
    try:
        with pytest.raises(ServerError, match="failed to initialize: RuntimeError: weights file no_such.pt is missing"):
            server.load("badinit")
        assert not server.model_ready("badinit")
        # Triton's strict readiness makes the server "not ready" once a model failed to load; it stays live and
        # serves the others.
        assert client.is_server_live() and server.model_ready("jsonsum") and server.model_ready("text")
        assert json.loads(_infer(client, "jsonsum", b'{"values": [1]}')[0])["sum"] == 3
    finally:
        shutil.rmtree(repository / "badinit")  # the module's other servers load every model in it


def test_handler_path_flag_serves_an_image_classifier_archive_with_its_handler_when_asked(tmp_path):
    from examples.migrate_torchserve import make_archive

    model = "import torch\n\n\nclass Net(torch.nn.Linear):\n    def __init__(self):\n        super().__init__(4, 2)\n"
    archive = make_archive(tmp_path, "imgc", model, _linear_state(), ["a", "b"])
    _build(archive, tmp_path / "repo", "--handler-path")
    assert [t.name for t in read_config(tmp_path / "repo" / "imgc").input] == ["BODY"]
    assert read_config(tmp_path / "repo" / "imgc").parameters["torchserve_handler"].string_value == "image_classifier"
    assert not (tmp_path / "repo" / "imgc_image").exists()


def test_build_repo_records_the_handler_models_engine_and_refuses_what_it_cannot_run(made, tmp_path, capsys):
    repo = tmp_path / "repo"

    def parameters(*flags):
        _build(made["jsonsum"], repo, "--force", *flags)
        return {key: value.string_value for key, value in read_config(repo / "jsonsum").parameters.items()}

    assert {k: v for k, v in parameters().items() if k != "torchserve_handler"} == {
        "archive_dir": "archive", "handler_engine": "openvino", "openvino_precision_hint": "f32",
        "engine_tolerance": "0.0001"}
    assert parameters("--precision", "auto")["openvino_precision_hint"] == ""  # OpenVINO's choice for the CPU
    assert parameters("--engine", "torch")["handler_engine"] == "eager"
    capsys.readouterr()
    for flags, message in ((["--engine", "onnxruntime"], "does not run a TorchServe handler's model"),
                           (["--engine", "torch", "--precision", "bf16"], "needs --engine openvino"),
                           (["--precision", "int8"], "not one the handler path runs")):
        assert build_repo.main(["--from-mar", str(made["jsonsum"]), "--output", str(repo), "--force", "--kind",
                                "cpu", "--trust-model-code", *flags]) != 0
        assert message in capsys.readouterr().err
    assert parameters("--engine", "torch")["handler_engine"] == "eager"  # a refused build left the last one


def test_engine_takes_the_models_forward_only_once_openvino_matched_it_and_only_for_calls_it_fits():
    import torch

    from backends import ts_engine

    class Handler:
        def __init__(self, model):
            self.model = model

        def handle(self, data, context):
            return data

    def service(model):
        return type("Service", (), {"_entry_point": Handler(model).handle})()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval()
    reports = []
    assert ts_engine.accelerate(service(model), "openvino", "f32", 1e-4, lambda m, w: reports.append((m, w))) == ""
    batch = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        eager = model(batch)  # the model's own forward; starts the conversion
        model.forward.thread.join(120)
        assert model.forward.state == "ready", reports
        assert reports and not reports[0][1] and "runs on OpenVINO" in reports[0][0]
        converted = model(torch.cat([batch, batch]))  # another batch size: the batch dimension is dynamic
        other = torch.randn(1, 3, 10, 10)
        assert torch.equal(model(other), model.forward.original(other))  # another image size: its own forward
    assert torch.allclose(converted, torch.cat([eager, eager]), rtol=0, atol=1e-5)
    assert model(batch).requires_grad  # gradients asked for (captum's explanations): its own forward
    assert "no torch model" in ts_engine.accelerate(type("S", (), {"_entry_point": print})(), "openvino", "f32",
                                                    1e-4, print)
    assert "training" in ts_engine.accelerate(service(torch.nn.Linear(2, 2)), "openvino", "f32", 1e-4, print)
    assert "as TorchServe runs it" in ts_engine.accelerate(service(model), "eager", "f32", 1e-4, print)


def test_engine_keeps_the_models_own_forward_when_openvino_answers_differently():
    import torch

    from backends import ts_engine

    class Noisy(torch.nn.Module):  # its answers depend on a random draw: OpenVINO cannot match the first batch
        def forward(self, x):
            return x + torch.rand_like(x)

    model, reports = Noisy().eval(), []
    handler = type("Handler", (), {"handle": lambda self, data, context: data})()
    handler.model = model
    ts_engine.accelerate(type("Service", (), {"_entry_point": handler.handle})(), "openvino", "f32", 1e-4,
                         lambda m, w: reports.append((m, w)))
    with torch.inference_mode():
        model(torch.zeros(2, 3))
        model.forward.thread.join(120)
    assert model.forward.state == "eager" and reports and reports[0][1], reports
    assert "stays on eager PyTorch" in reports[0][0]


def test_a_killed_handler_stub_is_replaced_by_the_supervisor_and_answers_again(made, tmp_path):
    import os
    import signal

    from perf.serve import ServeRepo
    from server.procfs import stubs_of

    repo = tmp_path / "repo"
    _build(made["text"], repo)
    serve = ServeRepo(repo)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports[0]}")
        assert _infer(client, "text", b"before") == (b"BEFORE", "text/plain; charset=utf-8")
        stub = next(s for s in stubs_of(serve.triton_pid) if s.model == "text" and s.alive)
        mark = len(serve.lines)
        os.kill(stub.pid, signal.SIGKILL)
        serve.wait_for("text: ready again", 120, mark)
        assert _infer(client, "text", b"after") == (b"AFTER", "text/plain; charset=utf-8")
        assert next(s for s in stubs_of(serve.triton_pid) if s.model == "text" and s.alive).pid != stub.pid
    finally:
        serve.stop()


# Predictions sum "values"; explanations (the "explain" header "True") double each; both say the batch they were in.
EXPLAINING_HANDLER = '''
import json

from ts.torch_handler.base_handler import BaseHandler


class Explaining(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def preprocess(self, data):
        return [json.loads(row.get("body")) for row in data]

    def inference(self, rows):
        return [{"sum": sum(row["values"]), "batch": len(rows)} for row in rows]

    def postprocess(self, answers):
        return answers

    def explain_handle(self, rows, raw_data):
        return [{"weights": [v * 2 for v in row["values"]], "batch": len(rows)} for row in rows]
'''


def test_explanations_and_predictions_batched_together_each_get_their_own_kind_when_sent_at_once(tmp_path,
                                                                                                  start_server):
    """TorchServe's BaseHandler reads the first request's "explain" header for the whole batch; the stub calls
    handle() once for the explanations and once for the predictions of a batch Triton formed."""
    repository = tmp_path / "repo"
    _build(_archive(tmp_path, "explaining", EXPLAINING_HANDLER, config=BATCHING), repository)
    server = start_server(repository)
    answers = _together(server, "explaining", [{"explain": str(index % 2 == 1)} for index in range(8)])
    assert [answer.get("weights", answer.get("sum")) for answer in answers] == \
        [[2 * index] if index % 2 else index for index in range(8)]
    assert max(answer["batch"] for answer in answers) > 1, answers  # batched, yet each got its own kind
