"""The GPU bench's load: closed-loop client processes over gRPC, one image per request (tensors through system shared
memory registered with Triton, so that Python clients do not starve a GPU; JPEGs as BYTES), and the point they make:
img/s, latencies, Triton's split of each request's time and the backend's own split of each execute."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np

from common.contract import IMAGE_INPUTS
from perf.gpu.engine import sample
from perf.stats import STAGES, counters, stage_split


def _client_process(url, model, kind, payload, threads, start, end, warmup, queue):
    """`threads` closed-loop clients; puts [(done, latency, ok), ...] measured in [start+warmup, end]."""
    import tritonclient.grpc as grpcclient
    from multiprocessing import shared_memory

    results, lock, regions = [], threading.Lock(), []

    def worker(index):
        client = grpcclient.InferenceServerClient(url)
        if kind == "jpeg":
            tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[payload]], dtype=object))
        else:
            shape, name = payload["shape"], f"bench_{mp.current_process().pid}_{index}"
            image = sample(shape, payload["dtype"], index)
            region = shared_memory.SharedMemory(name=name, create=True, size=image.nbytes)
            regions.append(region)
            np.ndarray(shape, image.dtype, region.buf)[...] = image
            client.register_system_shared_memory(name, "/" + name, image.nbytes)
            input_name, datatype = IMAGE_INPUTS[payload["dtype"]]
            tensor = grpcclient.InferInput(input_name, list(shape), datatype)
            tensor.set_shared_memory(name, image.nbytes)
        while time.monotonic() < start:
            time.sleep(0.001)
        local, checked = [], 0
        while True:
            sent = time.monotonic()
            if sent >= end:
                break
            try:
                answer = client.infer(model, [tensor])
                if checked < 3:  # the answer itself, not only its arrival: a few per client
                    logits = answer.as_numpy("LOGITS")  # raises where the response carries no data
                    if logits is None or not np.isfinite(logits).all():
                        raise ValueError(f"LOGITS {None if logits is None else logits.shape} not finite")
                    checked += 1
                ok = True
            except Exception as exc:
                ok = str(exc)[:300]
            done = time.monotonic()
            if start + warmup <= done <= end:
                local.append((done, done - sent, ok))
        with lock:
            results.extend(local)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    client = grpcclient.InferenceServerClient(url)
    for region in regions:  # after every thread's last request: Triton refuses to drop a region in use
        for _ in range(20):
            try:
                client.unregister_system_shared_memory(region.name.lstrip("/"))
                break
            except Exception:  # 2.51 may hold a finished request's region a moment longer
                time.sleep(0.1)
        region.close()
        region.unlink()
    queue.put(results)


def run_load(url, model, kind, payload, concurrency, seconds, processes, warmup=1.0, stats_model=None,
             split_folder=None) -> dict:
    """One closed-loop point: img/s, latencies, Triton's split of each request's time and, given the folder of a
    model in measurement mode (stage_timing=FOLDER), the backend's own split of each execute (ms per execute)."""
    import tritonclient.grpc as grpcclient

    ctx = mp.get_context("spawn")  # gRPC and fork do not mix
    queue = ctx.Queue()
    procs = min(processes, concurrency)
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    start = time.monotonic() + 2.5 + 0.3 * procs  # spawn + imports + shared memory registration
    end = start + warmup + seconds
    workers = [ctx.Process(target=_client_process, args=(url, model, kind, payload, n, start, end, warmup, queue))
               for n in shares]
    for w in workers:
        w.start()
    stats = grpcclient.InferenceServerClient(url)
    # Whose batches Triton's statistics count: the classifier (behind an ensemble) unless told otherwise.
    target = stats_model or (model if kind != "jpeg" else model.removesuffix("_image"))
    time.sleep(max(0.0, start + warmup - time.monotonic()))
    before = counters(stats, target)
    split_before = stage_split(split_folder, target) if split_folder else None
    completions = [c for _ in workers for c in queue.get()]
    after = counters(stats, target)
    split = (stage_split(split_folder, target) - split_before) if split_folder else None
    for w in workers:
        w.join()
    rows = payload["shape"][0] if kind == "tensor" and len(payload["shape"]) == 4 else 1
    good = sorted(done for done, _, ok in completions if ok is True)
    lat = np.array([latency for _, latency, ok in completions if ok is True] or [np.nan]) * 1000
    interval = after - before
    # Triton's own split of each request's time (per request, ms): where a slow point spends it.
    server = {f"{stage}_ms": interval.ms_per_request(stage) for stage in STAGES}
    return {"concurrency": concurrency, "requests": len(good), "errors": len(completions) - len(good),
            "images_per_s": rows * (len(good) - 1) / (good[-1] - good[0]) if len(good) > 1 else 0.0,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "avg_batch": interval.avg_batch if interval.executions else 0.0, **server,
            **({"execute_split_ms": split.ms_per_execute(), "split_executions": split.executions} if split else {}),
            "first_error": next((err for _, _, err in completions if err is not True), "")}
