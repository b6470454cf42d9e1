"""TorchServe 0.12 serving ResNet-152 on this machine with its docs' batching: the baseline our figures face.

Builds a .mar of torchvision ResNet-152 with the random weights `build-repo --model resnet152 --weights
random --seed 0` serves (model file + state_dict, TorchServe's image_classifier handler, ImageNet names),
registers it with batch_size 8 and max_batch_delay 50 ms (TorchServe's batch-inference docs), then
N closed-loop clients POST the sample photo to /predictions/NAME per concurrency level.

    python -m perf.torchserve_bench                      # c=1 and c=8, 20 s each
    python -m perf.torchserve_bench --concurrency 1 4 8 16 --seconds 30 --out perf/results/ts.json
"""
from __future__ import annotations

import http.client
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from common.cli import OneLineParser
from perf import load, torchserve
from perf.bench import ISA_FLAGS as ISA, cpuinfo
from perf.samples import CAT as SAMPLE

MODEL = "resnet152"


def cpu() -> dict:
    """The CPU as /proc/cpuinfo names it, the ISA flags that decide CPU inference speed (perf.bench's), and
    the cores this process may use."""
    flags = set(cpuinfo("flags").split())
    return {"model": cpuinfo("model name"), "isa": {flag: flag in flags for flag in ISA},
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def cpu_slug(model: str) -> str:
    """'Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz' -> 'intel-xeon-platinum-8480', 'AMD EPYC' -> 'amd-epyc'."""
    model = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\d+-core processor", " ", model.lower())
    return re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "cpu"


def versions(java: str) -> dict:
    import torch
    import torchvision

    java_line = subprocess.run([java, "-version"], capture_output=True, text=True).stderr.splitlines()
    return {"torchserve": metadata.version("torchserve"), "torch-model-archiver": metadata.version("torch-model-archiver"),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "python": platform.python_version(),
            "java": java_line[0] if java_line else "unknown", "platform": platform.platform()}


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/octet-stream"})
    reply = conn.getresponse()
    return reply.status, reply.read()


def rest_client(url: str, model: str, body: bytes):
    """perf.load's connect POSTing `body` to /predictions/MODEL: one keep-alive connection per client, as a real
    client pool holds, reopened after a failure; send() -> the answer's bytes, or raises."""
    host = urlsplit(url)

    def connect(index: int = 0):
        conn = [http.client.HTTPConnection(host.hostname, host.port, timeout=300)]

        def send() -> bytes:
            try:
                status, answer = post(conn[0], f"/predictions/{model}", body)
            except (OSError, http.client.HTTPException):
                conn[0].close()
                conn[0] = http.client.HTTPConnection(host.hostname, host.port, timeout=300)
                raise
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {answer[:200].decode(errors='replace')}")
            return answer

        return send, lambda: conn[0].close()

    return connect


def closed_loop(url: str, model: str, body: bytes, concurrency: int, seconds: float, warmup: float) -> dict:
    """`concurrency` clients, each POSTing `body` to /predictions/MODEL when its last answer has come."""
    return as_point(load.closed_loop(rest_client(url, model, body), concurrency, seconds, warmup=warmup), warmup,
                 json.loads)


def as_point(found: load.Load, warmup: float, decode=lambda answer: answer) -> dict:
    """perf.load's summary with the warm-up and the first good answer (decoded); the machine's 1-minute load average
    before and after sits in it: above its core count, something else was competing for the CPU."""
    answer = found.first_answer
    return {**found.summary(), "warmup_seconds": warmup, "sample_answer": None if answer is None else decode(answer)}


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m perf.torchserve_bench", description=__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="clients in flight, one level "
                   "after another. Default: 1 8.")
    p.add_argument("--seconds", type=float, default=20, help="measured seconds per level. Default: 20.")
    p.add_argument("--warmup", type=float, default=5, help="seconds of load before each level's measurement. "
                   "Default: 5.")
    p.add_argument("--batch-size", type=int, default=8, help="TorchServe's batch_size. Default: 8 (the docs').")
    p.add_argument("--max-batch-delay-ms", type=int, default=50, help="TorchServe's max_batch_delay. "
                   "Default: 50 (the docs').")
    p.add_argument("--workers", type=int, default=1, help="TorchServe workers for the model. Default: 1.")
    p.add_argument("--image", type=Path, default=SAMPLE, help="JPEG each request sends. Default: "
                   "clients/samples/chelsea.jpg.")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for a READY worker. "
                   "Default: 600.")
    p.add_argument("--out", type=Path, default=None, help="JSON to write. "
                   "Default: perf/results/torchserve-resnet152-<cpu>.json.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if min(args.concurrency) < 1 or args.seconds <= 0 or args.workers < 1 or args.batch_size < 1:
        print("perf.torchserve_bench: --concurrency, --seconds, --workers and --batch-size must be >= 1",
              file=sys.stderr)
        return 1
    try:
        commands = torchserve.executables()
    except torchserve.TorchServeError as exc:
        print(f"perf.torchserve_bench: {exc}", file=sys.stderr)
        return 1
    machine = cpu()
    out = args.out or Path("perf/results") / f"torchserve-{MODEL}-{cpu_slug(machine['model'])}.json"
    body = args.image.read_bytes()
    command = " ".join(["python -m perf.torchserve_bench", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "machine": {"cpu": machine, **versions(commands["java"])},
              "model": {"name": MODEL, "weights": "random: torch.manual_seed(0), torchvision resnet152(weights=None)",
                        "archive": "torch-model-archiver --model-file (ResNet subclass) --serialized-file "
                                   "(state_dict) --handler image_classifier, index_to_name.json (ImageNet)"},
              "settings": {"batch_size": args.batch_size, "max_batch_delay_ms": args.max_batch_delay_ms,
                           "workers": args.workers, "image": f"{args.image.name} ({len(body)} bytes)",
                           "clients": "closed loop, threads of this process on the same machine, "
                                      "one keep-alive HTTP connection each"},
              "levels": []}
    try:
        with tempfile.TemporaryDirectory(prefix="ts-bench-") as tmp:
            folder = Path(tmp)
            print(f"building {MODEL}.mar ...", file=sys.stderr)
            archive = torchserve.resnet_archive(folder / "model_store", MODEL, args.batch_size,
                                                   args.max_batch_delay_ms, args.workers)
            print("starting torchserve ...", file=sys.stderr)
            with torchserve.started(folder, archive, args.workers, args.start_timeout) as server:
                described = server.describe()
                registered = {"batch_size": described.get("batchSize"),
                              "max_batch_delay_ms": described.get("maxBatchDelay"),
                              "workers": len(described.get("workers", []))}
                result["registered"] = registered  # what TorchServe says it runs, not what we asked
                if (registered["batch_size"], registered["max_batch_delay_ms"]) != (args.batch_size,
                                                                                    args.max_batch_delay_ms):
                    raise torchserve.TorchServeError(f"TorchServe registered {registered}, not the settings asked")
                conn = http.client.HTTPConnection(urlsplit(server.inference_url).hostname,
                                                  urlsplit(server.inference_url).port, timeout=300)
                status, answer = post(conn, f"/predictions/{MODEL}", body)
                conn.close()
                result["sample_answer"] = json.loads(answer) if status == 200 else f"HTTP {status}"
                for level in args.concurrency:
                    point = closed_loop(server.inference_url, MODEL, body, level, args.seconds, args.warmup)
                    print(f"c={level}: {point['images_per_s']} img/s, p50 {point['p50_ms']} ms, "
                          f"p99 {point['p99_ms']} ms, errors {point['errors']}", file=sys.stderr)
                    result["levels"].append(point)
    except (torchserve.TorchServeError, OSError, subprocess.SubprocessError) as exc:
        print("perf.torchserve_bench: " + " ".join(str(exc).split())[:600], file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
