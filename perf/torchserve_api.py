"""TorchServe's REST API served on Triton against TorchServe 0.12 itself and against Triton's direct image path, one sitting.

One archive per model (torchvision ResNet, random weights seed 0, TorchServe's image_classifier handler, no batching
in the archive), registered through each server's management API with the seed walkthrough's values
(batch_size=8, max_batch_delay=10, initial_workers=1); one photo; one load generator (perf.torchserve_bench's: N
closed-loop clients, one keep-alive connection each). ResNet-152: TorchServe, then serve-repo --torchserve-config
at its default precision and with --precision auto, each through POST /predictions/NAME and, on the same running
server, as a tritonclient HTTP infer of NAME_image to tritonserver's own socket (c=1 p50, c=8 throughput); then
serve-repo --handler-path (the archive's own image_classifier handler in Triton's stub), its model on OpenVINO
(the default, measured once the stub said OpenVINO took over) and with --engine torch (eager, as TorchServe runs
it). ResNet-18: c=32 throughput through /predictions and direct.

    python -m perf.torchserve_api                                   # 20 s per measurement
    python -m perf.torchserve_api --seconds 3 --skip-torchserve     # a quick look
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import numpy as np

from common import names
from common.cli import OneLineParser, write_result
from common.contract import IMAGE_BYTES, LOGITS
from perf import load, torchserve
from perf.cpu_engines import resolved_precision
from perf.loadgen import encoded
from perf.samples import CAT
from perf.serve import TorchServeFront
from perf.torchserve_bench import as_point, closed_loop, cpu, cpu_slug, versions
from server.unix_http import get, sync_client

REGISTRATION = {"batch_size": 8, "max_batch_delay": 10, "initial_workers": 1}  # the seed walkthrough's
LEVELS = {"resnet152": (1, 8), "resnet18": (32,)}
HANDLER_FLAGS = ["--handler-path", "--trust-model-code"]  # the archive's own handler, TorchServe's code
# What the handler model's stub said about its engine (backends/ts_engine.py), waited for before measuring.
ENGINE_LINES = ("runs on OpenVINO", "stays on eager PyTorch", "runs on eager PyTorch")
TARGETS = {"fp32_c8_over_torchserve": (">=", 1.15), "auto_c8_over_torchserve": (">=", 2.3),
           "fp32_c1_p50_over_torchserve": ("<=", 0.6), "api_over_direct_c8": (">=", 0.95),
           "api_minus_direct_c1_p50_ms": ("<=", 1.0), "resnet18_api_over_direct_c32": (">=", 0.9),
           # issue 36: the same handler, TorchServe's, batched by Triton in its stub
           "handler_c8_over_torchserve": (">=", 1.2), "handler_c1_p50_over_torchserve": ("<=", 0.9)}


class BenchError(RuntimeError):
    """A server did not start, or a registration was refused or not served as asked."""


def _call(method: str, url: str, timeout: float = 900):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:
        raise BenchError(f"{method} {url.split('/', 3)[-1]}: HTTP {error.code} {error.read()[:300]!r}") from None


def register(management_url: str, name: str, timeout: float) -> dict:
    """POST /models?url=NAME.mar&REGISTRATION, then the server's own view of it once a worker is READY."""
    _call("POST", f"{management_url}/models?" + urlencode({"url": f"{name}.mar", **REGISTRATION}), timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        described = _call("GET", f"{management_url}/models/{name}")[0]
        if any(worker.get("status") == "READY" for worker in described.get("workers", [])):
            seen = {"batch_size": described.get("batchSize"), "max_batch_delay": described.get("maxBatchDelay"),
                    "initial_workers": len(described["workers"])}
            if seen != REGISTRATION:
                raise BenchError(f"{name} registered as {seen}, not as asked ({REGISTRATION})")
            return seen
        time.sleep(1)
    raise BenchError(f"no READY worker for {name} after {timeout:.0f} s")


def direct(url: str, model: str, body: bytes):
    """perf.load's connect for the image path: a tritonclient HTTP infer of MODEL_image with the photo's bytes
    (BYTES [1, 1]) to tritonserver at `url` (its Unix socket behind the front), one client per thread."""
    import tritonclient.http as httpclient

    def connect(index: int):
        client = sync_client(url, connection_timeout=300, network_timeout=300)
        image = httpclient.InferInput(IMAGE_BYTES, [1, 1], "BYTES")
        image.set_data_from_numpy(encoded(body, batched=True))
        wanted = [httpclient.InferRequestedOutput(LOGITS)]
        return (lambda: client.infer(names.image_model(model), [image], outputs=wanted).as_numpy(LOGITS)), client.close

    return connect


def top5(logits: np.ndarray) -> list[int]:
    return np.argsort(logits.ravel())[::-1][:5].tolist()


def summary(points: dict) -> dict:
    """The figures the targets read, from the points measured (c1 p50 and c8 throughput where measured)."""
    found = {"points": points}
    if "c1" in points:
        found["c1_p50_ms"] = points["c1"]["p50_ms"]
    for key, point in points.items():
        if key != "c1":
            # Whole batch intervals need a few batches; a point too short for them (seconds far below the
            # latency) is read over its window instead (both are in `points`).
            enough = point["requests"] >= 3 * point["concurrency"] and point["images_per_s"] > 0
            found[f"{key}_images_per_s"] = point["images_per_s"] if enough else point["images_per_s_window"]
    return found


def measure(send_to, name: str) -> dict:
    """One closed-loop run per concurrency level of the model; `send_to(level)` runs it."""
    points = {}
    for level in LEVELS[name]:
        points[f"c{level}"] = point = send_to(level)
        print(f"  c={level}: {point['images_per_s']} img/s (window {point['images_per_s_window']}), p50 {point['p50_ms']} "
              f"ms, errors {point['errors']}, load {point['loadavg_1min']}", file=sys.stderr)
    return summary(points)


def run_torchserve(folder: Path, archive: Path, body: bytes, args) -> dict:
    """TorchServe 0.12 with the archive registered again through its management API as the seed registers it."""
    with torchserve.started(folder, archive, 1, args.start_timeout, properties={"enable_model_api": "true"}) as server:
        _call("DELETE", f"{server.management_url}/models/{archive.stem}")  # loaded at start-up without batching
        registered = register(server.management_url, archive.stem, args.start_timeout)
        print("torchserve:", file=sys.stderr)
        return {"registered": registered, **measure(lambda c: closed_loop(
            server.inference_url, archive.stem, body, c, args.seconds, args.warmup), archive.stem)}


def run_ours(folder: Path, store: Path, flags: list[str], models: list[str], body: bytes, args, found: dict,
             straight_too: bool = True) -> dict:
    """serve-repo --torchserve-config with `flags`: each model registered, measured through /predictions and (with
    `straight_too`) direct, unregistered. Returns {model: {"ours": ..., "direct": ...}}."""
    try:
        front = TorchServeFront(folder, *flags, timeout=args.start_timeout, model_store=str(store),
                                enable_model_api="true", disable_token_authorization="true")
    except AssertionError as exc:
        raise BenchError(f"serve-repo {' '.join(flags)} did not start: {exc}") from None
    results = {}
    try:
        triton = front.triton_url
        found.setdefault("tritonserver", json.loads(get(triton, "/v2", 60))["version"])
        for name in models:
            registered = register(front.management_url, name, args.start_timeout)
            precision = resolved_precision(f"{front.metrics_url}/metrics", name)
            label = " ".join(["serve-repo", *flags])
            print(f"{label}, {name} ({precision}) through /predictions:", file=sys.stderr)
            engine = None if straight_too else settled(front, name, body, args.start_timeout)
            ours = measure(lambda c: closed_loop(front.inference_url, name, body, c, args.seconds, args.warmup),
                           name)
            if not straight_too:  # the handler path: no NAME_image to go to
                results[name] = {"ours": {"registered": registered, "engine": engine, **ours}}
                _call("DELETE", f"{front.management_url}/models/{name}")
                continue
            print(f"{label}, {name} direct to {names.image_model(name)}:", file=sys.stderr)
            straight = measure(lambda c: as_point(load.closed_loop(direct(triton, name, body), c, args.seconds,
                                                                   warmup=args.warmup), args.warmup, top5), name)
            # Both paths run the same classifier: the API's first label is the direct logits' top one (only the
            # first: a random ResNet-152's softmax is one 1.0 and zeros, whose order is arbitrary).
            labels = torchserve.imagenet_labels()
            answers = [point["sample_answer"] for point in (*ours["points"].values(), *straight["points"].values())]
            same = None if None in answers else len({next(iter(a)) if isinstance(a, dict) else labels[str(a[0])][1]
                                                     for a in answers}) == 1
            results[name] = {"ours": {"registered": registered, "precision_served": precision, **ours},
                             "direct": {"precision_served": precision, "same_top1_as_api": same, **straight}}
            _call("DELETE", f"{front.management_url}/models/{name}")
    finally:
        front.stop()
    return results


def settled(front: TorchServeFront, name: str, body: bytes, timeout: float) -> str:
    """The handler path's engine line: one prediction starts the model's conversion (OpenVINO takes over from the
    first batch it matched); measuring starts once the stub said which engine serves, read from Triton's log."""
    log = front.triton_log
    closed_loop(front.inference_url, name, body, 1, 0.1, 0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if name in line and any(text in line for text in ENGINE_LINES)]
        if lines:
            said = lines[-1][lines[-1].find(name):]
            print(f"  {said}", file=sys.stderr)
            return said
        time.sleep(0.5)
    raise BenchError(f"{name}: its stub said nothing about its engine in {timeout:.0f} s")


def _ratio(a, b, minus: bool = False):
    if a is None or b is None or (not minus and not b):
        return None
    return round(a - b, 2) if minus else round(a / b, 3)


def ratios(r152: dict | None, r18: dict | None) -> dict:
    def get(variant: str, key: str):
        return ((r152 or {}).get(variant) or {}).get(key)

    return {"fp32_c8_over_torchserve": _ratio(get("ours_fp32", "c8_images_per_s"), get("torchserve", "c8_images_per_s")),
            "auto_c8_over_torchserve": _ratio(get("ours_auto", "c8_images_per_s"), get("torchserve", "c8_images_per_s")),
            "fp32_c1_p50_over_torchserve": _ratio(get("ours_fp32", "c1_p50_ms"), get("torchserve", "c1_p50_ms")),
            "api_over_direct_c8": _ratio(get("ours_fp32", "c8_images_per_s"), get("direct_fp32", "c8_images_per_s")),
            "api_minus_direct_c1_p50_ms": _ratio(get("ours_fp32", "c1_p50_ms"), get("direct_fp32", "c1_p50_ms"), True),
            "resnet18_api_over_direct_c32": _ratio((r18 or {}).get("ours_c32_images_per_s"),
                                                   (r18 or {}).get("direct_c32_images_per_s")),
            "handler_c8_over_torchserve": _ratio(get("ours_handler", "c8_images_per_s"),
                                                 get("torchserve", "c8_images_per_s")),
            "handler_c1_p50_over_torchserve": _ratio(get("ours_handler", "c1_p50_ms"),
                                                     get("torchserve", "c1_p50_ms")),
            "handler_eager_c8_over_torchserve": _ratio(get("ours_handler_eager", "c8_images_per_s"),
                                                       get("torchserve", "c8_images_per_s")),
            "handler_eager_c1_p50_over_torchserve": _ratio(get("ours_handler_eager", "c1_p50_ms"),
                                                           get("torchserve", "c1_p50_ms"))}


def targets(found: dict) -> dict:
    return {key: {"target": f"{sign} {bound}", "value": found[key],
                  "met": None if found[key] is None else (found[key] >= bound if sign == ">=" else found[key] <= bound)}
            for key, (sign, bound) in TARGETS.items()}


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m perf.torchserve_api", description=__doc__)
    p.add_argument("--seconds", type=float, default=20, help="measured seconds per point. Default: 20.")
    p.add_argument("--warmup", type=float, default=5, help="seconds of the same load before each point's "
                   "measurement. Default: 5.")
    p.add_argument("--models", nargs="+", choices=tuple(LEVELS), default=list(LEVELS),
                   help="models to measure (resnet152: c=1 and c=8, every server; resnet18: c=32, ours and direct "
                        "at the default precision). Default: resnet152 resnet18.")
    p.add_argument("--skip-torchserve", action="store_true", help="leave TorchServe itself out (a quick run; "
                   "its figures and the ratios to them are null). Default: off.")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds a server start or a registration "
                   "(archive build included) may take. Default: 900.")
    p.add_argument("--out", type=Path, default=None, help="JSON to write. "
                   "Default: perf/results/torchserve-api-<cpu>.json.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0:
        print("perf.torchserve_api: --seconds must be > 0 and --warmup >= 0", file=sys.stderr)
        return 1
    try:
        commands = torchserve.executables()
    except torchserve.TorchServeError as exc:
        print(f"perf.torchserve_api: {exc}", file=sys.stderr)
        return 1
    began = time.monotonic()
    machine = {"cpu": cpu(), **versions(commands["java"])}
    out = args.out or Path("perf/results") / f"torchserve-api-{cpu_slug(machine['cpu']['model'])}.json"
    body = CAT.read_bytes()
    models = list(dict.fromkeys(args.models))
    result = {"machine": machine,
              "command": " ".join(["python -m perf.torchserve_api", *(sys.argv[1:] if argv is None else argv)]),
              "seconds": args.seconds, "warmup_seconds": args.warmup,
              "settings": {"registration": REGISTRATION, "image": f"{CAT.name} ({len(body)} bytes)",
                           "weights": "random: torch.manual_seed(0), torchvision ARCH(weights=None)",
                           "archive": "torch-model-archiver --handler image_classifier, model file + state_dict, "
                                      "index_to_name.json, no model-config.yaml",
                           "clients": "closed loop, threads of this process on the same machine; /predictions: one "
                                      "keep-alive HTTP connection each; direct: one tritonclient HTTP client each"},
              "resnet152": None, "resnet18": None}
    try:
        with tempfile.TemporaryDirectory(prefix="ts-api-bench-") as tmp:
            store = Path(tmp) / "model_store"
            archives = {name: torchserve.resnet_archive(store, name, None, None, None, arch=name) for name in models}
            fp32 = run_ours(Path(tmp) / "ours-fp32", store, [], models, body, args, machine)
            if "resnet152" in models:
                auto = run_ours(Path(tmp) / "ours-auto", store, ["--precision", "auto"], ["resnet152"], body, args,
                                machine)["resnet152"]
                result["resnet152"] = {
                    "torchserve": None if args.skip_torchserve else
                    run_torchserve(Path(tmp) / "torchserve", archives["resnet152"], body, args),
                    "ours_fp32": fp32["resnet152"]["ours"], "direct_fp32": fp32["resnet152"]["direct"],
                    "ours_auto": auto["ours"], "direct_auto": auto["direct"],
                    # issue 36: the archive's own image_classifier handler in Triton's stub (serve-repo --handler-path),
                    # its model on OpenVINO fp32 (the default) and on eager PyTorch as TorchServe runs it
                    "ours_handler": run_ours(Path(tmp) / "ours-handler", store, HANDLER_FLAGS, ["resnet152"], body,
                                             args, machine, straight_too=False)["resnet152"]["ours"],
                    "ours_handler_eager": run_ours(Path(tmp) / "ours-handler-eager", store,
                                                   [*HANDLER_FLAGS, "--engine", "torch"], ["resnet152"], body, args,
                                                   machine, straight_too=False)["resnet152"]["ours"]}
            if "resnet18" in models:
                ours, straight = fp32["resnet18"]["ours"], fp32["resnet18"]["direct"]
                result["resnet18"] = {"ours_c32_images_per_s": ours.pop("c32_images_per_s"),
                                      "direct_c32_images_per_s": straight.pop("c32_images_per_s"),
                                      "ours": ours, "direct": straight}
    except (BenchError, torchserve.TorchServeError, OSError) as exc:
        print("perf.torchserve_api: " + " ".join(str(exc).split())[:600], file=sys.stderr)
        return 1
    result["ratios"] = ratios(result["resnet152"], result["resnet18"])
    result["targets"] = targets(result["ratios"])
    result["took_s"] = round(time.monotonic() - began)
    print(json.dumps({"ratios": result["ratios"], "targets_met": {k: v["met"] for k, v in result["targets"].items()}},
                     indent=1), file=sys.stderr)
    write_result(result, out)
    print(f"wrote {out} ({result['took_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
