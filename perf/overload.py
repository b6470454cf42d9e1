"""Overload: what serving does at 1x, 2x and 4x capacity. Capacity is measured first (closed loop); then requests
arrive open-loop at a fixed rate (they do not wait for each other, as real users do not) and each outcome is timed:
accepted requests' latency, how fast a refused request learns it was refused, and requests that got no outcome.

--via proxy (the default, today's defaults): build-repo's defaults (no Triton queue policy) served by
`serve-repo --proxy on`, which bounds overload in HAProxy: at most --max-in-flight requests at Triton, a request
that would expect to wait over --queue-ms refused at once (HTTP 503 / gRPC UNAVAILABLE, "proxy rule overload"),
one that waited 2x that in the proxy's queue refused then. Capacity over the proxy's HTTP port, the open loop
over its gRPC port. --via triton (the old default): Triton's own queue policy (build-repo --max-queue-size /
--queue-timeout-ms), served by tritonserver alone.

    python -m perf.overload --out perf/results/overload-resnet18-proxy.json
    python -m perf.overload --serve-flags="--queue-ms 250" --out ...
    python -m perf.overload --via triton --queue-timeout-ms 1000 --max-queue-size 32 --out perf/results/overload-resnet18.json
    python -m perf.overload --tail 2000 --factors 4 --out ...       # the low-load tail first (perf/stalls.py's, folded)
"""
from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import names
from common.cli import OneLineParser, write_result
from perf.load import OpenLoop, closed_loop, spread


REFUSALS = ("queue_full", "timed_out", "overload", "overload_timed_out", "unavailable")


def classify(error: str) -> str:
    """An error's outcome: a refusal (one of REFUSALS: Triton's queue policy, the proxy's overload rule at once or
    after waiting its turn, another gRPC UNAVAILABLE) or "error: <text>"."""
    text = error.lower()
    if "proxy rule overload" in text:
        return "overload_timed_out" if "waited its turn too long" in text else "overload"
    if "exceeds maximum queue size" in text:
        return "queue_full"
    if "timeout" in text or "timed out" in text:
        return "timed_out"
    if "unavailable" in text:  # gRPC status 14 without the proxy's rule: refused all the same
        return "unavailable"
    return f"error: {error[:100]}"


def open_loop(grpc_url: str, model: str, image: np.ndarray, rate: float, seconds: float) -> dict:
    """Send at `rate` requests/s for `seconds` without waiting for answers (perf.load.OpenLoop); time every outcome."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    tensor = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    total = int(rate * seconds)
    sender = OpenLoop(lambda index, due: client.infer(model, [tensor], client_timeout=600), rate, total,
                      workers=1000).start()
    samples, sending = sender.stop(), sender.sending_s
    client.close()
    kinds: dict[str, list[float]] = {}
    for sample in samples:
        kinds.setdefault(classify(sample.error) if sample.error else "ok", []).append(sample.latency)
    refused = [latency for kind in REFUSALS for latency in kinds.get(kind, [])]
    level = {"rate": round(rate, 1), "sent": total, "answered": len(samples), "lost": total - len(samples),
             "achieved_send_rate": round(total / sending, 1) if sending else None,
             "worst_send_lag_ms": round(sender.lag * 1000, 1),
             "accepted": spread(kinds.pop("ok", [])), "rejected": spread(refused)}  # every refusal, whatever refused it
    for kind in REFUSALS:
        level[f"rejected_{kind}"] = spread(kinds.pop(kind, []))
    level["errors"] = sum(len(v) for v in kinds.values())  # neither an answer nor a refusal
    level["other_errors"] = {k: len(v) for k, v in kinds.items()}
    return level


SLOW = 5  # a request is a stall above SLOW x its run's p50


def tail(urls: dict, model: str, path: str, protocol: str, concurrency: int, requests: int,
         image: np.ndarray) -> dict:
    """The low-load tail (--tail): `concurrency` closed-loop clients (perf.load), `requests` in all after one each to
    warm its connection and the first batch; p50, p99, the largest and how many took over SLOW x p50 or 300 ms.
    Triton 2.51's dynamic batcher stops prefetching when a queue policy is set and can then sleep 500 ms with a
    request queued (docs/performance.md, "No stall by default"): this shows, per build, whether that happens."""
    from perf.loadgen import encoded, infer_client
    from perf.samples import CAT

    data = encoded(CAT.read_bytes(), batched=True) if path == "image" else image
    connect = infer_client(urls[protocol], names.image_model(model) if path == "image" else model, data, protocol)

    def warmed(index: int):
        send, close = connect(index)
        send()
        return send, close

    found = closed_loop(warmed, concurrency, requests=requests)
    ms = np.array([sample.latency for sample in found.samples if not sample.error]) * 1000
    p50 = float(np.percentile(ms, 50))
    return {"path": path, "protocol": protocol, "concurrency": concurrency, "requests": len(ms),
            "errors": len(found.samples) - len(ms), "p50_ms": round(p50, 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2), "max_over_p50": round(float(ms.max()) / p50, 2),
            f"over_{SLOW}x_p50": int((ms > SLOW * p50).sum()), "over_300_ms": int((ms > 300).sum())}


def targets(levels: list[dict]) -> dict:
    """The bounds overload should keep: accepted p99 at 4x <= 2000 ms, refusals' p99 <= 20 ms at every level,
    no request without an outcome. A level with no refusal meets the refusal bound."""
    at_4x = [level["accepted"].get("p99_ms") for level in levels if level["factor"] == 4]
    accepted = at_4x[0] if at_4x else None
    rejected = {f"{level['factor']:g}x": level["rejected"].get("p99_ms") for level in levels}
    lost = sum(level["lost"] for level in levels)
    checks = {
        "accepted_p99_ms_at_4x": {"limit": 2000, "value": accepted,
                                  "met": None if accepted is None else accepted <= 2000},
        "rejected_p99_ms": {"limit": 20, "value": rejected,
                            "met": all(value is None or value <= 20 for value in rejected.values())},
        "lost": {"limit": 0, "value": lost, "met": lost == 0},
    }
    checks["all_met"] = all(check["met"] is not False for check in checks.values())
    return checks


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.overload", description=__doc__)
    p.add_argument("--via", choices=("proxy", "triton"), default="proxy",
                   help="proxy: build-repo's defaults behind serve-repo --proxy on (the proxy bounds overload); "
                        "triton: Triton's queue policy (--max-queue-size / --queue-timeout-ms), tritonserver alone. "
                        "Default: proxy.")
    p.add_argument("--model", default="resnet18", help="Default: resnet18 (random weights).")
    p.add_argument("--max-batch-size", type=int, default=8, help="Default: 8.")
    p.add_argument("--max-queue-size", type=int, help="--via triton only. Default: 32.")
    p.add_argument("--queue-timeout-ms", type=float, help="--via triton only. Default: 1000.")
    p.add_argument("--serve-flags", default="", help="serve-repo flags, one string (e.g. \"--queue-ms 250\"); "
                                                       "--via proxy only. Default: none.")
    p.add_argument("--build-flags", default="", help="more build-repo flags, one string (e.g. \"--instances 2\"). "
                                                       "Default: none.")
    p.add_argument("--tail", type=int, default=0, metavar="N",
                   help="first the low-load tail: N closed-loop requests per path (tensor, image), protocol (gRPC, "
                        "HTTP) and concurrency (1, 2), each one's p50/p99/max and stalls (over 5x p50). Default: 0, "
                        "none.")
    p.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4], help="Default: 1 2 4.")
    p.add_argument("--seconds", type=float, default=20, help="per load level. Default: 20.")
    p.add_argument("--out", type=Path, help="JSON to write.")
    args = p.parse_args(argv)
    if args.via == "proxy" and (args.max_queue_size is not None or args.queue_timeout_ms is not None):
        p.error("--max-queue-size and --queue-timeout-ms are Triton's queue policy: --via triton")
    if args.via == "triton" and args.serve_flags:
        p.error("--serve-flags go to serve-repo: --via proxy")
    serve_flags = shlex.split(args.serve_flags)

    from builder import cli as build_repo
    from perf.bench import machine

    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        repo = Path(tmp) / "repo"
        flags = ["--model", args.model, "--weights", "random", "--output", str(repo), "--kind", "cpu",
                 "--max-batch-size", str(args.max_batch_size), *shlex.split(args.build_flags)]
        if args.via == "triton":
            flags += ["--max-queue-size", str(32 if args.max_queue_size is None else args.max_queue_size),
                      "--queue-timeout-ms", f"{1000 if args.queue_timeout_ms is None else args.queue_timeout_ms:g}"]
        if build_repo.main(flags):
            raise SystemExit("build-repo failed")
        if args.via == "proxy":
            measured = _via_proxy(repo, serve_flags, args, image)
        else:
            measured = _via_triton(repo, args, image)
    levels = measured["levels"]
    result = {"model": args.model, "via": args.via, "build_flags": flags[6:], "serve_flags": serve_flags,
              **{k: v for k, v in measured.items() if k != "levels"}, **({"tail": args.tail_runs} if args.tail else {}),
              "machine": machine(), "levels": levels, "targets": targets(levels)}
    print(write_result(result, args.out))
    lost = sum(level["lost"] for level in levels)
    return 0 if result["server_ready_after"] and not lost else 1


def _levels(http_url: str, grpc_url: str, args, image: np.ndarray) -> tuple[float, list[dict]]:
    """The tail (with --tail), capacity (closed loop over HTTP), then the open-loop levels over gRPC."""
    from perf.loadgen import run_load

    if args.tail:
        runs = [tail({"http": http_url, "grpc": grpc_url}, args.model, path, protocol, c, args.tail, image)
                for path in ("tensor", "image") for protocol in ("grpc", "http") for c in (1, 2)]
        for run in runs:
            print(json.dumps(run), flush=True)
        args.tail_runs = {"runs": runs, "worst_max_over_p50": max(run["max_over_p50"] for run in runs),
                          "stalls": sum(run[f"over_{SLOW}x_p50"] for run in runs)}

    # Capacity: as many clients as the batch holds, back to back (closed loop).
    capacity = run_load(http_url, args.model, args.max_batch_size, args.seconds, image, label="capacity").throughput
    print(f"capacity {capacity:.1f} req/s", flush=True)
    levels = []
    for factor in args.factors:
        level = open_loop(grpc_url, args.model, image, factor * capacity, args.seconds)
        level["factor"] = factor
        levels.append(level)
        print(json.dumps(level), flush=True)
        time.sleep(2)  # let the queue empty before the next level
    return capacity, levels


def _via_proxy(repo: Path, serve_flags: list[str], args, image: np.ndarray) -> dict:
    from perf.serve import ServeRepo

    serve = ServeRepo(repo, "--proxy", "on", *serve_flags)
    try:
        http_url, grpc_url = (f"127.0.0.1:{port}" for port in serve.ports[:2])
        capacity, levels = _levels(http_url, grpc_url, args, image)
        ready = serve.process.poll() is None and serve.http.is_server_ready()
        # What serve-repo said while it served (restarts of tritonserver or the proxy, quarantines...).
        said = [line for line in serve.lines if line != serve.ready_line]
    finally:
        serve.stop()
    return {"capacity_req_per_s": round(capacity, 1), **serve.overload_limits,
            "server_ready_after": ready, "serve_repo_said": said[-20:], "levels": levels}


def _via_triton(repo: Path, args, image: np.ndarray) -> dict:
    from server.triton import TritonServer

    with TritonServer.local(repo) as server:
        capacity, levels = _levels(server.http_url, server.grpc_url, args, image)
        ready = server.ready()
    return {"capacity_req_per_s": round(capacity, 1),
            "queue_timeout_ms": 1000 if args.queue_timeout_ms is None else args.queue_timeout_ms,
            "server_ready_after": ready, "levels": levels}


if __name__ == "__main__":
    sys.exit(main())
