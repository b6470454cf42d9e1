"""Closed-loop load against a Triton model, read together with Triton's own statistics."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import tritonclient.http as httpclient

from common.contract import IMAGE as INPUT, IMAGE_BYTES, LOGITS as OUTPUT
from common.modelconfig import from_json, served, to_json
from perf.stats import counters


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


def run_load(url: str, model: str, concurrency: int, seconds: float, image: np.ndarray,
             label: str = "", rate: float | None = None, warmup: float = 1.0, stats_model: str = "") -> Point:
    """`concurrency` clients send one request after another (or, with `rate`, at that total rate).

    `image`: an FP32 IMAGE tensor (the tensor path), or encoded bytes from `encoded` (the image path,
    where `stats_model` names the classifier whose batches Triton's statistics count)."""
    completions: list[tuple[float, float, bool]] = []  # (done, latency, ok)
    lock = threading.Lock()
    start_gate = threading.Barrier(concurrency + 1)
    timing = {}

    def worker(index: int) -> None:
        client = httpclient.InferenceServerClient(url, connection_timeout=120, network_timeout=120)
        as_bytes = image.dtype == object
        tensor = httpclient.InferInput(IMAGE_BYTES if as_bytes else INPUT, list(image.shape),
                                       "BYTES" if as_bytes else "FP32")
        tensor.set_data_from_numpy(image)
        outputs = [httpclient.InferRequestedOutput(OUTPUT)]
        interval = concurrency / rate if rate else 0.0
        start_gate.wait()
        next_send = time.perf_counter() + index * interval / max(concurrency, 1)
        while True:
            now = time.perf_counter()
            if now >= timing["end"]:
                return
            if interval:
                if now < next_send:
                    time.sleep(min(next_send - now, timing["end"] - now))
                    continue
                next_send += interval
            sent = time.perf_counter()
            try:
                client.infer(model, [tensor], outputs=outputs)
                ok = True
            except Exception:
                ok = False
            done = time.perf_counter()
            if timing["measure"] <= done <= timing["end"]:
                with lock:
                    completions.append((done, done - sent, ok))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    stats_client = httpclient.InferenceServerClient(url)
    begin = time.perf_counter()
    timing.update(measure=begin + warmup, end=begin + warmup + seconds)
    start_gate.wait()
    time.sleep(warmup)
    before = counters(stats_client, stats_model or model)
    for thread in threads:
        thread.join()
    after = counters(stats_client, stats_model or model)
    return _point(label, concurrency, seconds, completions, before, after)


def interval_rate(times: list[float], burst: float = 0.01) -> float:
    """Completions per second between the first and the last completion seen.

    A batched server answers in bursts (8 responses at once every batch); counting completions in a
    fixed window would be off by up to one burst. Dropping the first burst and dividing by the span
    from it to the last completion measures whole batch intervals only.
    """
    times = sorted(times)
    if len(times) < 2:
        return float("nan")
    first_burst = sum(1 for t in times if t - times[0] <= burst)
    span = times[-1] - times[0]
    return (len(times) - first_burst) / span if span > 0 else float("nan")


def _point(label, concurrency, seconds, completions, before, after) -> Point:
    good = [(done, latency) for done, latency, ok in completions if ok]
    lat_ms = np.array([latency for _, latency in good]) * 1000 if good else np.array([np.nan])
    interval = after - before
    return Point(
        config=label, concurrency=concurrency, requests=len(good), errors=len(completions) - len(good),
        seconds=seconds, throughput=interval_rate([done for done, _ in good]),
        p50_ms=float(np.percentile(lat_ms, 50)), p95_ms=float(np.percentile(lat_ms, 95)),
        p99_ms=float(np.percentile(lat_ms, 99)),
        avg_batch=interval.avg_batch, queue_ms=interval.ms_per_request("queue"), compute_ms=interval.compute_ms(),
    )


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
