"""Classify image files on a Triton server and print the top-k `label: probability` per image."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from common import names
from common.cli import OneLineParser

from common.contract import IMAGE_INPUTS, LOGITS as OUTPUT, config_parameters
from common.messages import first_line

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "uint8": np.uint8}


class ClientError(RuntimeError):
    """The server or its model is not what this client expects; the message says how."""


def connect(url: str, protocol: str):
    if protocol == "grpc":
        import tritonclient.grpc as client

        return client, grpc_client(url)
    import tritonclient.http as client

    return client, client.InferenceServerClient(url)


def grpc_client(url: str, max_reconnect_ms: int = 1000):
    """tritonclient's gRPC client, reconnecting at most `max_reconnect_ms` apart once the server went away.
    gRPC's own backoff grows to 120 s: after serve-repo restarted tritonserver (~10 s), a default client
    kept failing "failed to connect to all addresses" for seconds more (measured: 17 s vs HTTP's 11 s)."""
    import tritonclient.grpc as grpcclient

    size = grpcclient.MAX_GRPC_MESSAGE_SIZE  # what tritonclient sets when it chooses the channel arguments
    return grpcclient.InferenceServerClient(url, channel_args=[
        ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
        ("grpc.initial_reconnect_backoff_ms", min(200, max_reconnect_ms)),
        ("grpc.min_reconnect_backoff_ms", min(200, max_reconnect_ms)),
        ("grpc.max_reconnect_backoff_ms", max_reconnect_ms)])


def model_config(triton, model: str) -> dict:
    """The served config as a dict (the HTTP and gRPC clients return it differently)."""
    config = triton.get_model_config(model)
    if isinstance(config, dict):
        return config.get("config", config)
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(config.config, preserving_proto_field_name=True)


def check_model(triton, model: str) -> tuple[dict, str]:
    """The served config and what its one image input takes ("fp32", "fp16" or "uint8", see
    contract.IMAGE_INPUTS: build-repo's --input-dtype); one clear line unless `model` takes one of those
    [3, H, W] and returns LOGITS."""
    if not triton.is_server_ready():
        raise ClientError("server is not ready")
    if not triton.is_model_ready(model):
        raise ClientError(f"model {model!r} is not ready on the server")
    config = model_config(triton, model)
    inputs = config.get("input", [])
    outputs = {t["name"] for t in config.get("output", [])}
    known = {name: (dtype, f"TYPE_{datatype}") for dtype, (name, datatype) in IMAGE_INPUTS.items()}
    image = inputs[0] if inputs else {}
    if image.get("name") not in known or OUTPUT not in outputs:
        raise ClientError(f"model {model!r} has inputs {[t['name'] for t in inputs]} and outputs {sorted(outputs)}; "
                          f"expected one of the inputs {', '.join(known)} and the output {OUTPUT}")
    dtype, datatype = known[image["name"]]
    dims = [int(d) for d in image.get("dims", [])]
    if image.get("data_type") != datatype or len(dims) != 3 or dims[0] != 3:
        raise ClientError(f"{model}.{image['name']} is {image.get('data_type')} {dims}; expected {datatype} [3, H, W]")
    return config, dtype


def preprocess_for(config: dict, dtype: str = "fp32"):
    """The exact preprocessing the served model expects, as build-repo recorded it in the config; for
    uint8 only its resize and center crop (the server normalizes those pixels)."""
    from common.transforms import pixels_from_parameters, transform_from_parameters

    params = config_parameters(config)
    if "crop_size" not in params and "preprocess_weights" not in params:
        raise ClientError(f"model {config.get('name')!r} records no preprocessing (crop_size, mean, std, ...); "
                          "was it built by build-repo?")
    return pixels_from_parameters(params) if dtype == "uint8" else transform_from_parameters(params)


def load_images(paths: list[Path], transform, dtype: str = "fp32") -> np.ndarray:
    """The files decoded as the server decodes them (common/decoding.py: EXIF rotation, 16-bit, palette,
    CMYK), so the tensor path and the image path agree on a phone photo."""
    from common.decoding import ImageError, decode

    batch = []
    for path in paths:
        try:
            batch.append(transform(decode(path.read_bytes())).numpy())
        except (OSError, ImageError) as exc:
            raise ClientError(f"cannot read image {path}: {exc}") from exc
    return np.stack(batch).astype(NUMPY_DTYPES[dtype])


def infer_logits(client, triton, model: str, batch: np.ndarray, dtype: str = "fp32") -> np.ndarray:
    name, datatype = IMAGE_INPUTS[dtype]
    image = client.InferInput(name, list(batch.shape), datatype)
    image.set_data_from_numpy(batch)
    result = triton.infer(model, [image], outputs=[client.InferRequestedOutput(OUTPUT)])
    return result.as_numpy(OUTPUT)


def top_k(logits: np.ndarray, labels: list[str], k: int) -> list[list[tuple[str, float]]]:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    order = np.argsort(-probs, axis=1)[:, :k]
    return [[(labels[j] if j < len(labels) else str(j), float(p[j])) for j in row] for p, row in zip(probs, order)]


def labels_for(config: dict) -> list[str]:
    """Class names: the config's `labels` (migrated and custom models), else torchvision's weights meta
    (the same list build-repo wrote to labels.txt)."""
    import json

    import torchvision

    params = config_parameters(config)
    if params.get("labels"):
        return list(json.loads(params["labels"]))
    return list(torchvision.models.get_weight(params["preprocess_weights"]).meta["categories"])


def classify(paths: list[Path], url: str, protocol: str, model: str, k: int) -> list[list[tuple[str, float]]]:
    """The tensor path: preprocessed here as the model's config records, sent as its input takes it."""
    client, triton = connect(url, protocol)
    config, dtype = check_model(triton, model)
    weights = config_parameters(config).get("weights", "")
    if weights.startswith("random"):
        print(f"WARNING: {model} serves {weights} weights: these labels are meaningless.", file=sys.stderr)
    batch = load_images(paths, preprocess_for(config, dtype), dtype)
    max_batch = int(config.get("max_batch_size", 0))
    if max_batch == 0:  # unbatched model: one request per image
        logits = np.stack([infer_logits(client, triton, model, image, dtype) for image in batch])
    else:
        logits = np.concatenate([infer_logits(client, triton, model, batch[i:i + max_batch], dtype)
                                 for i in range(0, len(batch), max_batch)])
    return top_k(logits, labels_for(config), k)


def classify_raw(paths: list[Path], url: str, protocol: str, model: str, k: int) -> list[list[tuple[str, float]]]:
    """Send the files' bytes to the NAME_image ensemble (the server decodes, preprocesses and batches),
    then rank its logits into top-k probabilities, as TorchServe's image_classifier answers."""
    client, triton = connect(url, protocol)
    name = names.image_model(names.base_of(model))
    if not triton.is_model_ready(name):
        raise ClientError(f"model {name!r} is not ready on the server (build-repo writes it beside {model!r})")
    config = model_config(triton, name)
    max_batch = max(1, int(config.get("max_batch_size", 0)))
    logits = []
    for start in range(0, len(paths), max_batch):
        try:
            blobs = np.array([[p.read_bytes()] for p in paths[start:start + max_batch]], dtype=object)
        except OSError as exc:
            raise ClientError(f"cannot read {exc.filename}: {exc.strerror}") from exc
        tensor = client.InferInput("IMAGE_BYTES", list(blobs.shape), "BYTES")
        tensor.set_data_from_numpy(blobs)
        reply = triton.infer(name, [tensor], outputs=[client.InferRequestedOutput(OUTPUT)])
        logits.append(reply.as_numpy(OUTPUT))
    return top_k(np.concatenate(logits), labels_for(config), k)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m clients.classify", description=__doc__)
    p.add_argument("images", nargs="+", type=Path, help="image files (JPEG, PNG, ...).")
    p.add_argument("--url", default="127.0.0.1:8000", help="server address. Default: 127.0.0.1:8000 (HTTP).")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http", help="Default: http.")
    p.add_argument("--model", default="resnet152", help="model name on the server. Default: resnet152.")
    p.add_argument("--top-k", type=int, default=5, help="classes to print per image. Default: 5.")
    p.add_argument("--raw", action="store_true",
                   help="send the files' bytes to MODEL_image (decoding and preprocessing on the server, like "
                        "TorchServe's `curl -T kitten.jpg`). Default: off (preprocess here, send tensors).")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error("--top-k must be >= 1")
    try:
        if args.raw:
            results = classify_raw(args.images, args.url, args.protocol, args.model, args.top_k)
        else:
            results = classify(args.images, args.url, args.protocol, args.model, args.top_k)
    except ClientError as exc:
        print(f"classify: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # tritonclient's connection and server errors
        print(f"classify: error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 1
    for path, rows in zip(args.images, results):
        print(f"{path}:")
        for label, value in rows:  # TorchServe's image_classifier prints "label": probability
            print(f'    "{label}": {value:.10f}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
