"""Overload: what a bounded queue (build-repo --max-queue-size / --queue-timeout-ms) does at 1x, 2x and 4x
capacity. Capacity is measured first (closed loop); then requests arrive open-loop at a fixed rate (they do
not wait for each other, as real users do not) and each outcome is timed: accepted requests' latency, and
how fast a rejected request learns it was rejected.

    python -m perf.overload --queue-timeout-ms 1000 --max-queue-size 32 --out perf/results/overload-resnet18.json
"""
from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common.cli import OneLineParser, write_result


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ms = np.array(values) * 1000
    return {"n": len(values), "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1)}


def open_loop(grpc_url: str, model: str, image: np.ndarray, rate: float, seconds: float) -> dict:
    """Send at `rate` requests/s for `seconds` without waiting for answers; time every outcome."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    tensor = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    outcomes: list[tuple[float, str]] = []
    lock = threading.Lock()
    total = int(rate * seconds)
    all_done = threading.Event()

    def record(sent, result, error):
        latency = time.perf_counter() - sent
        kind = "ok"
        if error is not None:
            text = str(error).lower()
            kind = ("queue_full" if "exceeds maximum queue size" in text else
                    "timed_out" if "timeout" in text or "timed out" in text else f"error: {str(error)[:100]}")
        with lock:
            outcomes.append((latency, kind))
            if len(outcomes) == total:
                all_done.set()

    started = time.perf_counter()
    late = 0.0
    for index in range(total):
        due = started + index / rate
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        else:
            late = max(late, now - due)
        sent = time.perf_counter()
        client.async_infer(model, [tensor], lambda result, error, sent=sent: record(sent, result, error),
                           client_timeout=600)
    sending = time.perf_counter() - started
    all_done.wait(600)
    client.close()
    kinds: dict[str, list[float]] = {}
    for latency, kind in outcomes:
        kinds.setdefault(kind, []).append(latency)
    return {"rate": round(rate, 1), "sent": total, "answered": len(outcomes),
            "achieved_send_rate": round(total / sending, 1), "worst_send_lag_ms": round(late * 1000, 1),
            "accepted": _percentiles(kinds.pop("ok", [])),
            "rejected_queue_full": _percentiles(kinds.pop("queue_full", [])),
            "rejected_timed_out": _percentiles(kinds.pop("timed_out", [])),
            "other_errors": {k: len(v) for k, v in kinds.items()}}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.overload", description=__doc__)
    p.add_argument("--model", default="resnet18", help="Default: resnet18 (random weights).")
    p.add_argument("--max-batch-size", type=int, default=8, help="Default: 8.")
    p.add_argument("--max-queue-size", type=int, default=32, help="Default: 32.")
    p.add_argument("--queue-timeout-ms", type=float, default=1000, help="Default: 1000.")
    p.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4], help="Default: 1 2 4.")
    p.add_argument("--seconds", type=float, default=20, help="per load level. Default: 20.")
    p.add_argument("--out", type=Path, help="JSON to write.")
    args = p.parse_args(argv)

    from builder import cli as build_repo
    from perf.loadgen import run_load
    from server.triton import TritonServer

    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        repo = Path(tmp) / "repo"
        flags = ["--model", args.model, "--weights", "random", "--output", str(repo), "--kind", "cpu",
                 "--max-batch-size", str(args.max_batch_size), "--max-queue-size", str(args.max_queue_size),
                 "--queue-timeout-ms", f"{args.queue_timeout_ms:g}"]
        if build_repo.main(flags):
            raise SystemExit("build-repo failed")
        with TritonServer.local(repo) as server:
            # Capacity: as many clients as the batch holds, back to back (closed loop).
            capacity = run_load(server.http_url, args.model, args.max_batch_size, args.seconds, image,
                                label="capacity").throughput
            print(f"capacity {capacity:.1f} req/s", flush=True)
            levels = []
            for factor in args.factors:
                level = open_loop(server.grpc_url, args.model, image, factor * capacity, args.seconds)
                level["factor"] = factor
                levels.append(level)
                print(json.dumps(level), flush=True)
                time.sleep(2)  # let the queue empty before the next level
            ready = server.ready()
    bound_ms = args.queue_timeout_ms
    result = {"model": args.model, "build_flags": flags[6:], "capacity_req_per_s": round(capacity, 1),
              "queue_timeout_ms": bound_ms, "server_ready_after": ready, "levels": levels}
    print(write_result(result, args.out))
    lost = sum(level["sent"] - level["answered"] for level in levels)
    return 0 if ready and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
