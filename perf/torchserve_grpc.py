"""TorchServe's gRPC Predictions served on Triton against TorchServe 0.12's own, one sitting (issue 45).

One ResNet-152 archive (torchvision, random weights seed 0, TorchServe's image_classifier handler), registered
through each server's management API with the seed walkthrough's values (batch_size=8, max_batch_delay=10,
initial_workers=1); one photo; closed-loop clients (perf.torchserve_bench's), each with a gRPC channel of its own
(`InferenceAPIsService.Predictions`, TorchServe's inference.proto) or a keep-alive HTTP connection (REST
/predictions): c=1 p50 and c=8 throughput, gRPC and REST, on serve-repo's TorchServe front, then on TorchServe 0.12.

    python -m perf.torchserve_grpc                         # 20 s per measurement
    python -m perf.torchserve_grpc --seconds 3 --warmup 1  # a quick look
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from common.cli import OneLineParser, write_result
from perf import torchserve
from perf.samples import CAT
from perf.serve import TorchServeFront
from perf.torchserve_api import _call, measure, register
from perf.torchserve_bench import closed_loop, closed_loop_of, cpu, cpu_slug, versions

NAME = "resnet152"


def grpc_loop(address: str, model: str, body: bytes, concurrency: int, seconds: float, warmup: float) -> dict:
    """`concurrency` clients, each calling Predictions on a channel of its own when its last answer has come."""
    import grpc

    from server.torchserve.proto import inference_pb2, inference_pb2_grpc

    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": body})

    def connect():
        channel = grpc.insecure_channel(address)
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)

        def send() -> tuple[str, bytes]:
            try:
                return "", stub.Predictions(request, timeout=300).prediction
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}", b""

        return send, channel.close

    return closed_loop_of(connect, concurrency, seconds, warmup, json.loads)


def both(rest_url: str, grpc_address: str, body: bytes, args) -> dict:
    print("  gRPC:", file=sys.stderr)
    over_grpc = measure(lambda c: grpc_loop(grpc_address, NAME, body, c, args.seconds, args.warmup), NAME)
    print("  REST:", file=sys.stderr)
    over_rest = measure(lambda c: closed_loop(rest_url, NAME, body, c, args.seconds, args.warmup), NAME)
    return {"grpc": over_grpc, "rest": over_rest}


def run_ours(folder: Path, store: Path, body: bytes, args) -> dict:
    front = TorchServeFront(folder, timeout=args.start_timeout, model_store=str(store), enable_model_api="true",
                            disable_token_authorization="true")
    try:
        registered = register(front.management_url, NAME, args.start_timeout)
        print("serve-repo's TorchServe front:", file=sys.stderr)
        return {"registered": registered, **both(front.inference_url, f"127.0.0.1:{front.grpc_ports[0]}", body, args)}
    finally:
        front.stop()


def run_torchserve(folder: Path, archive: Path, body: bytes, args) -> dict:
    with torchserve.started(folder, archive, 1, args.start_timeout, properties={"enable_model_api": "true"}) as server:
        _call("DELETE", f"{server.management_url}/models/{NAME}")  # loaded at start-up without batching
        registered = register(server.management_url, NAME, args.start_timeout)
        print("TorchServe 0.12:", file=sys.stderr)
        return {"registered": registered, **both(server.inference_url, server.grpc_inference, body, args)}


def ratios(ours: dict, theirs: dict) -> dict:
    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    return {"grpc_c8_ours_over_torchserve": ratio(ours["grpc"].get("c8_images_per_s"),
                                                  theirs["grpc"].get("c8_images_per_s")),
            "grpc_c1_p50_ours_over_torchserve": ratio(ours["grpc"].get("c1_p50_ms"), theirs["grpc"].get("c1_p50_ms")),
            "ours_grpc_minus_rest_c1_p50_ms": round(ours["grpc"]["c1_p50_ms"] - ours["rest"]["c1_p50_ms"], 2),
            "torchserve_grpc_minus_rest_c1_p50_ms": round(theirs["grpc"]["c1_p50_ms"] - theirs["rest"]["c1_p50_ms"],
                                                          2)}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.torchserve_grpc", description=__doc__)
    p.add_argument("--seconds", type=float, default=20, help="per measurement. Default: 20.")
    p.add_argument("--warmup", type=float, default=5, help="seconds before each. Default: 5.")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, help="JSON to write. Default: perf/results/torchserve-grpc-CPU.json")
    args = p.parse_args(argv)
    commands = torchserve.executables()
    began = time.monotonic()
    machine = {"cpu": cpu(), **versions(commands["java"])}
    out = args.out or Path("perf/results") / f"torchserve-grpc-{cpu_slug(machine['cpu']['model'])}.json"
    body = CAT.read_bytes()
    result = {"machine": machine,
              "command": " ".join(["python -m perf.torchserve_grpc", *(sys.argv[1:] if argv is None else argv)]),
              "seconds": args.seconds, "warmup_seconds": args.warmup, "image": f"{CAT.name} ({len(body)} bytes)"}
    with tempfile.TemporaryDirectory(prefix="ts-grpc-bench-") as tmp:
        store = Path(tmp) / "model_store"
        archive = torchserve.resnet_archive(store, NAME, None, None, None, arch=NAME)
        result["ours"] = run_ours(Path(tmp) / "ours", store, body, args)
        result["torchserve"] = run_torchserve(Path(tmp) / "torchserve", archive, body, args)
    result["ratios"] = found = ratios(result["ours"], result["torchserve"])
    result["targets"] = {
        "grpc_c8_ours_over_torchserve": {"target": ">= 1.15", "met": (found["grpc_c8_ours_over_torchserve"] or 0)
                                         >= 1.15},
        "ours_grpc_minus_rest_c1_p50_ms": {"target": "<= 2", "met": found["ours_grpc_minus_rest_c1_p50_ms"] <= 2}}
    result["took_s"] = round(time.monotonic() - began)
    print(json.dumps({"ratios": found}, indent=1), file=sys.stderr)
    write_result(result, out)
    print(f"wrote {out} ({result['took_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
