"""GPU benchmark: served img/s vs the same engine with the batch on the GPU, per precision and CUDA graphs, and JPEGs.

Clients are processes sending one image per gRPC request (perf.gpu.load); tensors travel through system shared memory
(registered with Triton) so that Python clients do not starve an H100. JPEGs go as BYTES over gRPC.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import names
from common.cli import OneLineParser

from common.contract import IMAGE_INPUTS, config_parameters
from perf.gpu.engine import InProcess
from perf.gpu.load import run_load


def parser():
    p = OneLineParser(prog="python -m perf.gpu.bench", description=__doc__)
    p.add_argument("--model", default="resnet152", help="torchvision model. Default: resnet152.")
    p.add_argument("--plan", nargs="+", default=["fp16:1", "fp32:1", "jpeg", "unbatched", "bf16:1", "fp16:0", "fp32:0"],
                   help="what to measure, in order: PRECISION:GRAPHS (tensor path, 1 = CUDA graphs), "
                        "unbatched and jpeg (both with the best tensor config so far). "
                        "Default: fp16:1 fp32:1 jpeg unbatched bf16:1 fp16:0 fp32:0.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256],
                   help="requests in flight (one image each). Default: 1 64 256.")
    p.add_argument("--seconds", type=float, default=8.0,
                   help="measurement per point (and the in-process runner's, at most 3 s). Default: 8.")
    p.add_argument("--warmup-s", type=float, default=1.0,
                   help="load before each point's measurement starts. Default: 1.")
    p.add_argument("--images-per-request", type=int, default=1,
                   help="images in each tensor-path request (fewer, larger requests). Default: 1.")
    p.add_argument("--processes", type=int, default=8, help="client processes. Default: 8.")
    p.add_argument("--input-dtype", choices=tuple(IMAGE_INPUTS), default="fp32",
                   help="the classifier's one input (build-repo --input-dtype), which tensor-path clients and the "
                        "in-process runner send: fp32 IMAGE, fp16 IMAGE_FP16 (half the bytes) or uint8 IMAGE_UINT8 "
                        "pixels (a quarter, normalized on the GPU). Default: fp32.")
    p.add_argument("--jpeg", type=Path, default=Path("clients/samples/chelsea.jpg"),
                   help="photo sent on the JPEG path. Default: clients/samples/chelsea.jpg.")
    p.add_argument("--instances", type=int, default=None,
                   help="classifier (and fused model) instances (build-repo --instances). Default: build-repo's "
                        "(4 on gpu). Instances x precision: run once per count, e.g. 1, 2, 4.")
    p.add_argument("--image-model", choices=("auto", "ensemble", "fused"), default="auto",
                   help="what NAME_image is (build-repo --image-model). Default: auto (fused on gpu).")
    p.add_argument("--io-variant", default=None,
                   help="a way of serving from perf.gpu.io_variants.IO_VARIANTS (the repository as built, then changed). "
                        "Default: none, the repository as build-repo writes it.")
    p.add_argument("--timeout-s", type=float, default=600,
                   help="the server's start (weights, CUDA graphs per bucket). Default: 600.")
    p.add_argument("--kind", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: a smoke run of this script without a GPU (plan items fp32:0 only). Default: gpu.")
    p.add_argument("--output", type=Path, default=Path("perf/results/gpu-resnet152.json"),
                   help="JSON written (and rewritten after every point). Default: perf/results/gpu-resnet152.json.")
    return p


def reload(client, model, base, **changes) -> None:
    config = json.loads(json.dumps(base))
    for key, value in changes.pop("parameters", {}).items():
        config.setdefault("parameters", {})[key] = {"string_value": str(value)}
    config.update(changes)
    if config.get("max_batch_size", 0) == 0:
        config.pop("dynamic_batching", None)
    client.load_model(model, config=json.dumps(config))
    if not client.is_model_ready(model):
        raise RuntimeError(f"{model} not ready after reload with {changes}")


def _tensor_variant(item, client, server, repo, base, params, max_batch, args, result, best):
    precision, graphs = item.split(":")
    # stage_timing: the backend's split of each execute (CUDA events, no extra waits) in args.split_folder
    change = {"precision": precision, "cuda_graphs": graphs, "stage_timing": str(args.split_folder)}
    t = time.monotonic()
    if result["tensor"] or any(params.get(k) != v for k, v in change.items()):  # the first is built so
        reload(client, args.model, base, parameters=change)
    entry = {"precision": precision, "cuda_graphs": graphs == "1", "reload_s": time.monotonic() - t, "points": []}
    result["tensor"].append(entry)
    local = InProcess(repo / args.model, {**params, **change}, max_batch, "cuda" if args.kind == "gpu" else "cpu")
    for c in args.concurrency:
        payload = {"shape": [args.images_per_request, 3, 224, 224], "dtype": args.input_dtype}
        point = run_load(server.grpc_url, args.model, "tensor", payload, c, args.seconds, args.processes, args.warmup_s,
                         split_folder=args.split_folder)
        rows, reference_s = max(1, round(point["avg_batch"])), min(args.seconds, 2.0)
        # The reference: the same engine, precision and graphs with the batch already on the device, at the batch
        # size the served batches ran at (their bucket, full); the runner fed from host memory stays beside it.
        point["engine_batch"] = local.runner.bucket_for(rows)
        point["inprocess_images_per_s"] = local.on_device(rows, reference_s)
        point["served_over_inprocess"] = point["images_per_s"] / point["inprocess_images_per_s"]
        point["runner_from_host_images_per_s"] = local.measure(rows, reference_s, dtype=args.input_dtype)
        point["served_over_runner_from_host"] = point["images_per_s"] / point["runner_from_host_images_per_s"]
        entry["points"].append(point)
        print(json.dumps({"variant": item, **point}), flush=True)
        if best is None or point["images_per_s"] > best[1]["images_per_s"]:
            best = (change, point)
    local.close()
    result["loaded"] = change
    return best


def _unbatched(client, server, base, best, args, result):
    change = best[0] if best else {}
    reload(client, args.model, base, max_batch_size=0, parameters=change)
    c = max(args.concurrency)
    payload = {"shape": [3, 224, 224], "dtype": args.input_dtype}
    point = run_load(server.grpc_url, args.model, "tensor", payload, c, args.seconds, args.processes, args.warmup_s,
                     split_folder=args.split_folder)
    result["unbatched"].append({**change, **point})
    print(json.dumps({"unbatched": True, **point}), flush=True)
    batched = [p for e in result["tensor"] if best and e["precision"] == change["precision"]
               and e["cuda_graphs"] == (change["cuda_graphs"] == "1") for p in e["points"] if p["concurrency"] == c]
    if batched:
        result["batched_over_unbatched"] = batched[0]["images_per_s"] / point["images_per_s"]
    reload(client, args.model, base, parameters=change)
    result["loaded"] = change
    client.load_model(names.image_model(args.model))  # an ensemble fails while its classifier runs unbatched


def _jpeg(client, server, base, best, args, result):
    if best and result.get("loaded") != best[0]:  # the JPEG path runs the best tensor config
        reload(client, args.model, base, parameters=best[0])
        result["loaded"] = best[0]
    image = names.image_model(args.model)
    image_base = client.get_model_config(image, as_json=True)["config"]
    fused = image_base.get("backend") == "python"  # --image-model fused (the GPU default): one stub
    # Fused: NAME_image runs the best tensor config itself and decodes where told; ensemble: its
    # preprocess step decodes where told, the classifier runs the best config.
    target = image if fused else names.named(args.model, "preprocess")
    target_base = image_base if fused else client.get_model_config(target, as_json=True)["config"]
    payload = args.jpeg.read_bytes()
    result["jpeg_file"] = f"{args.jpeg.name} ({len(payload)} bytes)"
    result["jpeg_model"] = "fused" if fused else "ensemble"
    for where in ("gpu", "cpu"):
        reload(client, target, target_base,
               parameters={"decode_device": where, **(best[0] if fused and best else {})})
        for c in args.concurrency:
            point = run_load(server.grpc_url, image, "jpeg", payload, c, args.seconds, args.processes, args.warmup_s,
                             stats_model=image if fused else None, split_folder=args.split_folder)
            result["jpeg"].append({"decode": where, **(best[0] if best else {}), **point})
            print(json.dumps({"jpeg": where, **point}), flush=True)
    reload(client, target, target_base)
    tensor_best = result.get("served_images_per_s")
    gpu_best = max((p["images_per_s"] for p in result["jpeg"] if p["decode"] == "gpu"), default=0)
    cpu_best = max((p["images_per_s"] for p in result["jpeg"] if p["decode"] == "cpu"), default=0)
    result["jpeg_images_per_s"] = max(gpu_best, cpu_best)  # the image-bytes path at its best decode
    result["jpeg_decode"] = "gpu" if gpu_best >= cpu_best else "cpu"
    if tensor_best:
        result["jpeg_gpu_over_tensor"] = gpu_best / tensor_best
        result["jpeg_over_tensor"] = result["jpeg_images_per_s"] / tensor_best
    if cpu_best:
        result["jpeg_gpu_over_cpu_decode"] = gpu_best / cpu_best


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    repo = Path(tempfile.mkdtemp(prefix="gpubench-")) / "repo"
    try:
        return _bench(args, argv, repo)
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)  # the built repository and its weights (~135 MB)


def _bench(args, argv, repo: Path) -> int:
    import torch
    import tritonclient.grpc as grpcclient

    from builder import cli as build_repo
    from perf.gpu.weights import calibrated_weights
    from server.triton import TritonServer

    args.split_folder = repo.parent / "stage-split"  # the classifier's measurement mode writes here
    first = next((item.split(":") for item in args.plan if ":" in item), ["fp32", "0"])
    weights = calibrated_weights(args.model, repo.parent, "cuda" if args.kind == "gpu" else "cpu")
    if build_repo.main(["--model", args.model, "--weights", str(weights), "--output", str(repo), "--kind", args.kind,
                        "--image-model", args.image_model, "--precision", first[0], "--input-dtype", args.input_dtype,
                        *(["--instances", str(args.instances)] if args.instances else []), "--cuda-graphs" if first[1] == "1" else "--no-cuda-graphs"]):
        return 1
    result = {"command": " ".join(["python -m perf.gpu.bench", *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(0) if args.kind == "gpu" else "cpu", "torch": torch.__version__, "model": args.model,
              "client": f"{args.processes} processes, gRPC, {args.images_per_request} image(s) per tensor request, "
                        f"{args.input_dtype} tensors via system shared memory",
              "input_dtype": args.input_dtype, "instances": args.instances or "build-repo's default",
              "seconds_per_point": args.seconds, "tensor": [], "unbatched": [], "jpeg": []}

    def save():
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")

    from perf.gpu.io_variants import apply_io_variant, io_variant_env

    flags = apply_io_variant(repo, args.io_variant) if args.io_variant else []
    result["io_variant"] = args.io_variant
    server = TritonServer.local(repo, model_control="explicit", log_file=args.output.with_suffix(".tritonserver.log"),
                                extra_args=flags, env=io_variant_env(args.io_variant or ""))
    server.start(timeout=args.timeout_s)
    try:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        base = client.get_model_config(args.model, as_json=True)["config"]
        max_batch = int(base["max_batch_size"])
        params = config_parameters(base)
        best = None
        for item in args.plan:
            if ":" in item:
                best = _tensor_variant(item, client, server, repo, base, params, max_batch, args, result, best)
                result["served_images_per_s"] = best[1]["images_per_s"]
                result["served_over_inprocess"] = best[1]["served_over_inprocess"]
                result["best"] = {**best[0], "concurrency": best[1]["concurrency"], "avg_batch": best[1]["avg_batch"]}
            elif item == "unbatched":
                _unbatched(client, server, base, best, args, result)
            elif item == "jpeg":
                _jpeg(client, server, base, best, args, result)
            save()
    finally:
        server.stop()
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
