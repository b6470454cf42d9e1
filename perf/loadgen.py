"""Triton clients for perf.load's engine, and its points read together with Triton's own statistics."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import tritonclient.http as httpclient

from common.contract import IMAGE as INPUT, IMAGE_BYTES, LOGITS as OUTPUT
from common.modelconfig import from_json, served, to_json
from perf.load import closed_loop
from perf.stats import counters, settled_counters


@dataclass
class Point:
    """One measured load point."""

    config: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    throughput: float  # images per second
    p50_ms: float
    p95_ms: float
    p99_ms: float
    avg_batch: float  # inferences per execution, from Triton's statistics
    queue_ms: float  # average time a request waited in the batcher's queue
    compute_ms: float  # average compute (input + infer + output) per request
    engine: str = ""
    inprocess_same_batch: float = 0.0  # the same engine in-process at round(avg_batch), measured right after

    def as_dict(self) -> dict:
        return asdict(self)


def sample(side: int, batched: bool, seed: int = 0) -> np.ndarray:
    image = np.random.default_rng(seed).standard_normal((3, side, side)).astype(np.float32)
    return image[None] if batched else image


def encoded(data: bytes, batched: bool) -> np.ndarray:
    """One encoded image as the image path's IMAGE_BYTES input ([1, 1] batched, [1] not)."""
    element = np.array([data], dtype=object)
    return element[None] if batched else element


def infer_client(url: str, model: str, image: np.ndarray, protocol: str = "http", timeout: float = 120):
    """perf.load's connect for a Triton model: one client per thread sending `image` (an FP32 IMAGE tensor, or
    encoded bytes from `encoded`) over HTTP or gRPC; send() -> LOGITS."""
    if protocol == "grpc":
        import tritonclient.grpc as module
    else:
        module = httpclient

    def connect(index: int):
        if protocol == "grpc":
            client = module.InferenceServerClient(url)
        else:
            client = module.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
        as_bytes = image.dtype == object
        tensor = module.InferInput(IMAGE_BYTES if as_bytes else INPUT, list(image.shape), "BYTES" if as_bytes else "FP32")
        tensor.set_data_from_numpy(image)
        outputs = [module.InferRequestedOutput(OUTPUT)]
        return (lambda: client.infer(model, [tensor], outputs=outputs).as_numpy(OUTPUT)), client.close

    return connect


def run_load(url: str, model: str, concurrency: int, seconds: float, image: np.ndarray,
             label: str = "", rate: float | None = None, warmup: float = 1.0, stats_model: str = "") -> Point:
    """`concurrency` closed-loop HTTP clients (perf.load) sending `image` (or, with `rate`, at that total rate),
    with Triton's statistics of the interval.

    `image`: an FP32 IMAGE tensor (the tensor path), or encoded bytes from `encoded` (the image path, where
    `stats_model` names the classifier whose batches Triton's statistics count)."""
    stats_client = httpclient.InferenceServerClient(url)
    before = []
    load = closed_loop(infer_client(url, model, image), concurrency, seconds, warmup=warmup, rate=rate,
                       at_measure=lambda: before.append(counters(stats_client, stats_model or model)))
    interval = settled_counters(stats_client, stats_model or model) - before[0]
    found = load.summary()
    return Point(config=label, concurrency=concurrency, requests=found["requests"], errors=found["errors"],
                 seconds=seconds, throughput=found["images_per_s"] or float("nan"),
                 **{f"p{q}_ms": found.get(f"p{q}_ms", float("nan")) for q in (50, 95, 99)},
                 avg_batch=interval.avg_batch, queue_ms=interval.ms_per_request("queue"),
                 compute_ms=interval.compute_ms())


def batching_override(base: dict, max_batch_size: int, delay_us: int, instances: int | None = None,
                      preferred: tuple[int, ...] = ()) -> dict:
    """A whole config (Triton's load API wants the full JSON) with new batching settings."""
    config = json.loads(json.dumps(base))
    config["max_batch_size"] = max_batch_size
    if max_batch_size > 0:
        policy = config.get("dynamic_batching", {}).get("default_queue_policy")
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us,
                                      "preferred_batch_size": list(preferred)}
        if policy:  # the queue bounds stay what build-repo wrote
            config["dynamic_batching"]["default_queue_policy"] = policy
    else:
        config.pop("dynamic_batching", None)
    return to_json(served(from_json(config), instances)) if instances else config


def load_with(client, model: str, config: dict) -> None:
    """Reload `model` live with `config` (needs --model-control explicit); raise if it fails."""
    client.load_model(model, config=json.dumps(config))
    if not client.is_model_ready(model):
        raise RuntimeError(f"model {model} did not become ready with the new config")
