"""Compact inputs, chosen when the repository is built (--input-dtype): IMAGE_UINT8 pixels and IMAGE_FP16 give
IMAGE's logits, normalized where the model runs; the ensemble hands the classifier the same compact tensor."""
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from backends.batch_runner import BatchRunner
from clients import classify
from common.contract import IMAGE_INPUTS, mean_std
from common.modelconfig import parameters, read_config
from common.transforms import pixels_from_parameters, transform_from_parameters
from images import CAT, cat
from server.triton import TritonServer
from support import SMALL, build, reference_logits, reference_model, relative_error

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the GPU path needs one (CI has none)"))]
MODELS = {"fp32": SMALL, "fp16": f"{SMALL}_fp16", "uint8": f"{SMALL}_uint8"}


@pytest.fixture(scope="module")
def compact(tmp_path_factory):
    """resnet18 (same seed) built three times, one per --input-dtype, served by one real tritonserver."""
    repo = tmp_path_factory.mktemp("compact") / "model_repository"
    for dtype, name in MODELS.items():
        build(repo, "--input-dtype", dtype, "--name", name, "--max-batch-size", "8", "--max-queue-delay-us", "2000")
    with TritonServer.local(repo) as server:
        yield repo, server


def _normalize(pixels: np.ndarray, stats=IMAGENET) -> np.ndarray:
    """What torchvision's transforms do after the crop: [0, 1], then Normalize."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in stats)
    return torch.from_numpy(pixels).float().div(255).sub(mean).div(std).numpy()


def _as(dtype: str, pixels: np.ndarray) -> np.ndarray:
    """The batch as the input of `dtype` takes it."""
    return pixels if dtype == "uint8" else _normalize(pixels).astype(np.float16 if dtype == "fp16" else np.float32)


def _send(url: str, protocol: str, tensors: dict[str, np.ndarray], model: str) -> np.ndarray:
    """One request carrying `tensors` ({input name: array}); the Triton data type follows the array's."""
    module = httpclient if protocol == "http" else grpcclient
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", np.dtype(np.uint8): "UINT8"}
    inputs = []
    for name, array in tensors.items():
        tensor = module.InferInput(name, list(array.shape), datatypes[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return module.InferenceServerClient(url).infer(model, inputs).as_numpy("LOGITS")


def _input(dtype: str, array: np.ndarray) -> dict[str, np.ndarray]:
    return {IMAGE_INPUTS[dtype][0]: array}


def _send_jpeg(url: str, model: str) -> np.ndarray:
    tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[CAT.read_bytes()]], dtype=object))
    return httpclient.InferenceServerClient(url).infer(model, [tensor]).as_numpy("LOGITS")


def test_build_repo_writes_one_required_input_and_the_same_hop_when_input_dtype_is_chosen(compact):
    repo, _ = compact
    for dtype, name in MODELS.items():
        tensor, datatype = IMAGE_INPUTS[dtype]
        config = read_config(repo / name)
        assert [(t.name, mc.DataType.Name(t.data_type), t.optional) for t in config.input] == \
            [(tensor, f"TYPE_{datatype}", False)]
        pre = read_config(repo / f"{name}_preprocess")
        assert [(t.name, mc.DataType.Name(t.data_type)) for t in pre.output] == [(tensor, f"TYPE_{datatype}")]
        steps = read_config(repo / f"{name}_image").ensemble_scheduling.step
        assert dict(steps[0].output_map) == {tensor: "image"} and dict(steps[1].input_map) == {tensor: "image"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_same_photo_gives_same_logits_when_the_model_takes_uint8_fp16_or_fp32(compact, small_model, protocol):
    repo, server = compact
    url = server.http_url if protocol == "http" else server.grpc_url
    params = parameters(read_config(repo / SMALL))
    normalized = transform_from_parameters(params)(cat()).numpy()[None]
    pixels = pixels_from_parameters(params)(cat()).numpy()[None]
    assert pixels.dtype == np.uint8 and pixels.shape == normalized.shape == (1, 3, 224, 224)
    sent = {"fp32": normalized, "fp16": normalized.astype(np.float16), "uint8": pixels}
    served = {dtype: _send(url, protocol, _input(dtype, batch), MODELS[dtype]) for dtype, batch in sent.items()}
    assert relative_error(served["fp32"], reference_logits(small_model, normalized)) <= 1e-4
    assert relative_error(served["uint8"], served["fp32"]) <= 1e-5
    assert relative_error(served["fp16"], served["fp32"]) <= 1e-2
    assert {dtype: int(logits.argmax()) for dtype, logits in served.items()} == \
        dict.fromkeys(sent, int(served["fp32"].argmax()))


def test_image_path_gives_fp32_logits_when_the_hop_is_uint8_or_fp16(compact):
    _, server = compact
    served = {dtype: _send_jpeg(server.http_url, f"{name}_image") for dtype, name in MODELS.items()}
    assert relative_error(served["uint8"], served["fp32"]) <= 1e-5  # PIL resizes in uint8: the hop loses nothing
    assert relative_error(served["fp16"], served["fp32"]) <= 1e-2


ZEROS = np.zeros((1, 3, 224, 224), np.float32)
PIXELS = np.zeros((1, 3, 224, 224), np.uint8)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"IMAGE": ZEROS}, "IMAGE"),
        ({"IMAGE_UINT8": ZEROS}, "IMAGE_UINT8"),
        ({"IMAGE_UINT8": np.zeros((1, 3, 100, 100), np.uint8)}, "unexpected shape"),
    ],
    ids=["another-models-input", "uint8-input-sent-as-fp32", "small-image"],
)
def test_bad_request_gets_error_and_neighbours_succeed_when_sent_concurrently(compact, small_model, tensors, message):
    _, server = compact
    pixels = np.random.default_rng(2).integers(0, 256, (6, 3, 224, 224), dtype=np.uint8)
    model = MODELS["uint8"]
    with ThreadPoolExecutor(7) as pool:
        bad = pool.submit(_send, server.http_url, "http", tensors, model)
        neighbours = [pool.submit(_send, server.http_url, "http", _input("uint8", pixels[i:i + 1]), model)
                      for i in range(len(pixels))]
        with pytest.raises(InferenceServerException, match=message):
            bad.result()
        served = [f.result() for f in neighbours]
    expected = reference_logits(small_model, _normalize(pixels))
    for i, rows in enumerate(served):
        assert relative_error(rows, expected[i:i + 1]) <= 1e-4, f"request {i}"
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready(model)


@pytest.mark.parametrize("device", DEVICES)
def test_runner_gives_fp32_normalized_rows_when_uint8_fp16_and_fp32_parts_share_a_run(device):
    device = torch.device(device)
    pixels = np.random.default_rng(3).integers(0, 256, (7, 3, 4, 4), dtype=np.uint8)
    expected = torch.from_numpy(_normalize(pixels)).flatten(1)
    runner = BatchRunner(torch.nn.Flatten(), device, (3, 4, 4), buckets=[1, 2, 4, 8], mean_std=IMAGENET)
    parts = [torch.from_numpy(pixels[:2]), torch.from_numpy(_as("fp16", pixels[2:3])),
             torch.from_numpy(_as("fp32", pixels[3:5])), torch.from_numpy(pixels[5:6]),
             torch.from_numpy(_as("fp16", pixels[6:7]))]
    if device.type == "cuda":  # one compact part already on the GPU, as from CUDA shared memory
        parts[3] = parts[3].to(device)
    rows = runner.run(parts)
    assert rows.shape == expected.shape and rows.dtype == torch.float32 and rows.device.type == "cpu"
    exact = [0, 1, 3, 4, 5]  # uint8 and fp32 rows: the client-side normalization, to float32 rounding
    torch.testing.assert_close(rows[exact], expected[exact], rtol=0, atol=1e-6)
    torch.testing.assert_close(rows[[2, 6]], expected[[2, 6]], rtol=0, atol=4e-3)  # fp16 keeps ~3 digits


def test_runner_refuses_uint8_parts_when_the_config_records_no_mean_and_std():
    runner = BatchRunner(torch.nn.Flatten(), torch.device("cpu"), (3, 4, 4))
    with pytest.raises(ValueError, match="mean and std"):
        runner.run([torch.zeros((1, 3, 4, 4), dtype=torch.uint8)])


class _Flat:
    """An engine as OpenVINO's and onnxruntime's: NumPy rows in (host), torch rows in (call), rows flattened."""

    def host(self, batch):
        return batch.reshape(batch.shape[0], -1)

    def __call__(self, batch):
        return batch.reshape(batch.shape[0], -1)


def test_host_runner_gives_the_batch_runners_rows_bit_for_bit_when_parts_are_compact_or_mixed():
    """The CPU stubs of OpenVINO and onnxruntime models gather rows with NumPy (HostRunner, no torch in the stub):
    the same float32 arithmetic as BatchRunner's, so the same bits."""
    from backends.classifier import HostRunner

    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, (5, 3, 4, 4), dtype=np.uint8)
    f16 = rng.standard_normal((2, 3, 4, 4)).astype(np.float16)
    f32 = rng.standard_normal((3, 3, 4, 4)).astype(np.float32)
    runner = BatchRunner(_Flat(), torch.device("cpu"), (3, 4, 4), channels_last=False, mean_std=IMAGENET)
    host = HostRunner(_Flat(), (3, 4, 4), IMAGENET)
    for parts in ([u8], [f16, u8, f32], [f32], [f32, f32[:1]]):
        rows = host.run(parts)
        assert rows.dtype == np.float32
        assert np.array_equal(rows, runner.run([torch.from_numpy(part) for part in parts]).numpy())
    with pytest.raises(ValueError, match="mean and std"):
        HostRunner(_Flat(), (3, 4, 4)).run([u8])


def test_cpu_openvino_classifier_answers_without_importing_torch_when_loaded_as_triton_does(repository, tmp_path):
    """Its version folder on sys.path and its model.py imported, as python_backend's stub does: the host path
    loads the engine and answers torch's logits without torch ever imported (~3 s of CPU less per stub start)."""
    import json
    import subprocess
    import sys

    version = repository / SMALL / "1"
    params = parameters(read_config(repository / SMALL))
    assert params["engine"] == "openvino"
    code = ("import json, sys; import numpy as np; sys.path.insert(0, sys.argv[1]); import model; "
            "params = json.loads(sys.argv[2]); runner = model.build_host_runner(model.Path(sys.argv[1]), params, "
            "(3, 224, 224), 2); runner.warm_up(); "
            "rows = runner.run([np.load(sys.argv[3])]); np.save(sys.argv[3], rows); "
            "print(json.dumps({'torch': 'torch' in sys.modules, 'torchvision': 'torchvision' in sys.modules}))")
    images = np.random.default_rng(1).standard_normal((2, 3, 224, 224)).astype(np.float32)
    path = tmp_path / "rows.npy"
    np.save(path, images)
    done = subprocess.run([sys.executable, "-c", code, str(version), json.dumps(params), str(path)],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"torch": False, "torchvision": False}
    rows = np.load(path)
    assert relative_error(rows, reference_logits(reference_model(), images)) < 1e-4


def test_mean_std_reads_the_config_parameters_when_present():
    assert mean_std({"mean": "0.5,0.25,0", "std": "1,2,4"}) == ([0.5, 0.25, 0.0], [1.0, 2.0, 4.0])
    assert mean_std({"preprocess_weights": "ResNet18_Weights.IMAGENET1K_V1"}) is None


def _top(capsys, url: str, model: str) -> list[tuple[str, float]]:
    assert classify.main([str(CAT), "--url", url, "--model", model, "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [(label, float(p)) for label, p in (re.fullmatch(r'\s+"(.+)": ([0-9.]+)', l).groups() for l in lines[1:])]


def test_classify_sends_what_the_model_takes_and_prints_fp32s_answer_when_its_input_is_compact(compact, capsys):
    _, server = compact
    fp32, uint8, fp16 = (_top(capsys, server.http_url, MODELS[d]) for d in ("fp32", "uint8", "fp16"))
    assert uint8[0][0] == fp16[0][0] == fp32[0][0]
    np.testing.assert_allclose([p for _, p in uint8], [p for _, p in fp32], atol=1e-5)
