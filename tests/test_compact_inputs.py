"""Compact inputs: IMAGE_UINT8 pixels and IMAGE_FP16 give IMAGE's logits, normalized where the model runs."""
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backends.batch_runner import BatchRunner
from clients import classify
from common.contract import IMAGE_INPUTS, mean_std
from common.modelconfig import parameters, read_config
from common.transforms import pixels_from_parameters, transform_from_parameters
from images import CAT, cat
from support import SMALL, reference_logits, relative_error

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the GPU path needs one (CI has none)"))]


def _normalize(pixels: np.ndarray, stats=IMAGENET) -> np.ndarray:
    """What torchvision's transforms do after the crop: [0, 1], then Normalize."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in stats)
    return torch.from_numpy(pixels).float().div(255).sub(mean).div(std).numpy()


def _as(dtype: str, pixels: np.ndarray) -> np.ndarray:
    """The batch as the input of `dtype` takes it."""
    return pixels if dtype == "uint8" else _normalize(pixels).astype(np.float16 if dtype == "fp16" else np.float32)


def _send(url: str, protocol: str, tensors: dict[str, np.ndarray], model: str = SMALL) -> np.ndarray:
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


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_same_photo_gives_same_logits_when_sent_as_uint8_fp16_or_fp32(server, repository, small_model, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    if not url:
        pytest.skip("TRITON_GRPC_URL not set for the external server")
    params = parameters(read_config(repository / SMALL))
    normalized = transform_from_parameters(params)(cat()).numpy()[None]
    pixels = pixels_from_parameters(params)(cat()).numpy()[None]
    assert pixels.dtype == np.uint8 and pixels.shape == normalized.shape == (1, 3, 224, 224)
    sent = {"fp32": normalized, "fp16": normalized.astype(np.float16), "uint8": pixels}
    served = {dtype: _send(url, protocol, _input(dtype, batch)) for dtype, batch in sent.items()}
    assert relative_error(served["fp32"], reference_logits(small_model, normalized)) <= 1e-4
    assert relative_error(served["uint8"], served["fp32"]) <= 1e-5
    assert relative_error(served["fp16"], served["fp32"]) <= 1e-2
    assert {dtype: int(logits.argmax()) for dtype, logits in served.items()} == \
        dict.fromkeys(sent, int(served["fp32"].argmax()))


ZEROS = np.zeros((1, 3, 224, 224), np.float32)
PIXELS = np.zeros((1, 3, 224, 224), np.uint8)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"IMAGE": ZEROS, "IMAGE_UINT8": PIXELS}, "exactly one of the inputs IMAGE, IMAGE_FP16, IMAGE_UINT8"),
        ({"IMAGE_UINT8": ZEROS}, "IMAGE_UINT8"),
        ({"IMAGE_FP16": np.zeros((1, 3, 100, 100), np.float16)}, "unexpected shape"),
    ],
    ids=["two-inputs", "uint8-input-sent-as-fp32", "fp16-small-image"],
)
def test_bad_request_gets_error_and_mixed_neighbours_succeed_when_sent_concurrently(
        server, small_model, tensors, message):
    pixels = np.random.default_rng(2).integers(0, 256, (6, 3, 224, 224), dtype=np.uint8)
    dtypes = ["fp32", "fp16", "uint8"] * 2  # neighbours of every dtype, batched together with the bad one
    with ThreadPoolExecutor(7) as pool:
        bad = pool.submit(_send, server.http_url, "http", tensors)
        neighbours = [pool.submit(_send, server.http_url, "http", _input(d, _as(d, pixels[i:i + 1])))
                      for i, d in enumerate(dtypes)]
        with pytest.raises(InferenceServerException, match=message):
            bad.result()
        served = [f.result() for f in neighbours]
    expected = reference_logits(small_model, _normalize(pixels))
    for i, (dtype, rows) in enumerate(zip(dtypes, served)):
        assert relative_error(rows, expected[i:i + 1]) <= (1e-2 if dtype == "fp16" else 1e-4), f"request {i}"
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready(SMALL)


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


def test_mean_std_reads_the_config_parameters_when_present():
    assert mean_std({"mean": "0.5,0.25,0", "std": "1,2,4"}) == ([0.5, 0.25, 0.0], [1.0, 2.0, 4.0])
    assert mean_std({"preprocess_weights": "ResNet18_Weights.IMAGENET1K_V1"}) is None


def _top(capsys, url: str, *options: str) -> list[tuple[str, float]]:
    assert classify.main([str(CAT), "--url", url, "--model", SMALL, "--top-k", "3", *options]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [(label, float(p)) for label, p in (re.fullmatch(r'\s+"(.+)": ([0-9.]+)', l).groups() for l in lines[1:])]


def test_classify_prints_fp32_top1_when_input_dtype_is_uint8_or_fp16(server, capsys):
    fp32 = _top(capsys, server.http_url)
    uint8 = _top(capsys, server.http_url, "--input-dtype", "uint8")
    fp16 = _top(capsys, server.http_url, "--input-dtype", "fp16")
    assert uint8[0][0] == fp16[0][0] == fp32[0][0]
    np.testing.assert_allclose([p for _, p in uint8], [p for _, p in fp32], atol=1e-5)


def test_classify_refuses_input_dtype_when_raw(server, capsys):
    with pytest.raises(SystemExit):
        classify.main([str(CAT), "--url", server.http_url, "--raw", "--input-dtype", "uint8"])
    assert "--input-dtype" in capsys.readouterr().err
