"""The GPU bench's clients for perf.load: gRPC, one image per request (tensors through system shared memory registered
with Triton, so that Python clients do not starve a GPU; JPEGs as BYTES), in client processes; and the point they
make: perf.load's result, Triton's split of each request's time and the backend's own split of each execute."""
from __future__ import annotations

import functools
import time

import numpy as np

from common import names
from common.contract import IMAGE_INPUTS
from perf.gpu.engine import sample
from perf.load import closed_loop
from perf.stats import STAGES, counters, settled_counters, stage_split


def connect(url, model, kind, payload, index):
    """One client: send() infers one request and checks the answer itself (LOGITS there and finite) for its first
    three; close() drops its shared memory region."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    import tritonclient.grpc as grpcclient

    client, region = grpcclient.InferenceServerClient(url), None
    if kind == "jpeg":
        tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[payload]], dtype=object))
    else:
        shape, name = payload["shape"], f"bench_{mp.current_process().pid}_{index}"
        image = sample(shape, payload["dtype"], index)
        region = shared_memory.SharedMemory(name=name, create=True, size=image.nbytes)
        np.ndarray(shape, image.dtype, region.buf)[...] = image
        client.register_system_shared_memory(name, "/" + name, image.nbytes)
        input_name, datatype = IMAGE_INPUTS[payload["dtype"]]
        tensor = grpcclient.InferInput(input_name, list(shape), datatype)
        tensor.set_shared_memory(name, image.nbytes)
    checked = [0]

    def send():
        answer = client.infer(model, [tensor])
        if checked[0] < 3:  # the answer itself, not only its arrival: a few per client
            logits = answer.as_numpy("LOGITS")  # raises where the response carries no data
            if logits is None or not np.isfinite(logits).all():
                raise ValueError(f"LOGITS {None if logits is None else logits.shape} not finite")
            checked[0] += 1

    def close():
        if region is None:
            return
        for _ in range(20):  # after this client's last request; 2.51 may hold a finished request's region a moment
            try:
                client.unregister_system_shared_memory(region.name.lstrip("/"))
                break
            except Exception:
                time.sleep(0.1)
        region.close()
        region.unlink()

    return send, close


def run_load(url, model, kind, payload, concurrency, seconds, processes, warmup=1.0, stats_model=None,
             split_folder=None) -> dict:
    """One closed-loop point: perf.load's result (img/s, latencies, errors), Triton's split of each request's time
    and, given the folder of a model in measurement mode (stage_timing=FOLDER), the backend's own split of each
    execute (ms per execute)."""
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(url)
    # Whose batches Triton's statistics count: the classifier (behind an ensemble) unless told otherwise.
    target = stats_model or (model if kind != "jpeg" else names.base_of(model))
    before = {}

    def at_measure():
        before.update(counters=counters(stats, target), split=stage_split(split_folder, target) if split_folder else None)

    found = closed_loop(functools.partial(connect, url, model, kind, payload), concurrency, seconds, warmup=warmup,
                        processes=processes, at_measure=at_measure)
    interval = settled_counters(stats, target) - before["counters"]
    split = (stage_split(split_folder, target) - before["split"]) if split_folder else None
    rows = payload["shape"][0] if kind == "tensor" and len(payload["shape"]) == 4 else 1
    # Triton's own split of each request's time (per request, ms): where a slow point spends it.
    server = {f"{stage}_ms": interval.ms_per_request(stage) for stage in STAGES}
    return {**found.summary(rows), "avg_batch": interval.avg_batch if interval.executions else 0.0, **server,
            **({"execute_split_ms": split.ms_per_execute(), "split_executions": split.executions} if split else {}),
            "first_error": next((s.error for s in found.samples if s.error), "")}
