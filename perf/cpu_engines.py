"""CPU engines side by side on the image path: per engine x precision, in-process and served, against TorchServe.

Builds one repository (ResNet-152, random weights seed 0; an int8 export calibrated on scikit-image's
photos when a variant asks for it), serves it once, and for each ENGINE:PRECISION reloads the classifier
live with that engine and measures, in this one sitting:

- in-process: the backend's own runner (build_runner) at batch 1 and 8, and the image path's whole work
  (decode + preprocess + forward) at the batch size the server formed;
- served: the sample JPEG sent as IMAGE_BYTES to NAME_image (the ensemble TorchServe users call) by N
  closed-loop HTTP clients: img/s, p50/p95/p99, the classifier's average batch;
- then a batching sweep of the first variant (unbatched, max batch 8 with delays, with and without
  queue bounds) on the image and the tensor path, from which the CPU defaults are chosen.

    python -m perf.cpu_engines --torchserve perf/results/torchserve-resnet152-amd-epyc.json
    python -m perf.cpu_engines --quick            # resnet18, two variants, short points: ~2 min
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

from common import names
from common.cli import OneLineParser
from common.modelconfig import from_json, to_json
from common.modelconfig import served as served_config
from perf import loadgen
from perf.bench import InProcess, machine
from perf.samples import CAT as SAMPLE

VARIANTS = ["openvino:auto", "openvino:fp32", "openvino:int8", "onnxruntime:fp32", "torch:fp32", "torch:bf16"]
# (label, dynamic batching?, max_queue_delay_us, keep build-repo's queue bounds?, classifier instances),
# the batching applied to both stubs. Max batch stays 8 throughout (no dynamic batcher: batch 1).
SWEEP = [("unbatched", False, 0, True, 1), ("b8 d0", True, 0, True, 1), ("b8 d0, no queue bounds", True, 0, False, 1),
         ("b8 d2ms", True, 2_000, True, 1), ("b8 d5ms", True, 5_000, True, 1), ("b8 d0, 2 instances", True, 0, True, 2)]
# scikit-image's photos other than the served cat: int8's calibration set (crops of each, as in the tests).
CALIBRATION = ("astronaut", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "stereo_motorcycle")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m perf.cpu_engines", description=__doc__)
    p.add_argument("--model", default=None, help="torchvision model. Default: resnet152 (resnet18 with --quick).")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"ENGINE:PRECISION to compare. Default: {' '.join(VARIANTS)} (bf16 ones only where the "
                        "CPU has it; two with --quick).")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="clients in flight. Default: 1 8.")
    p.add_argument("--seconds", type=float, default=None, help="measurement per point. Default: 15 (2 quick).")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the batching sweep.")
    p.add_argument("--torchserve", type=Path, default=None,
                   help="a perf.torchserve_bench JSON from this machine and sitting, to compare with.")
    p.add_argument("--output", type=Path, default=Path("perf/results"), help="directory. Default: perf/results.")
    p.add_argument("--name", default=None, help="file stem. Default: cpu-engines-<cpu>.")
    p.add_argument("--quick", action="store_true", help="resnet18, openvino:auto and onnxruntime:fp32, 2 s points.")
    return p


def default_variants(quick: bool) -> list[str]:
    from common.cpu import cpu_bf16

    if quick:
        return ["openvino:auto", "onnxruntime:fp32"]
    return [v for v in VARIANTS if cpu_bf16() or not v.endswith(":bf16")]


def calibration_folder(folder: Path) -> Path:
    """Three crops of each CALIBRATION photo (one mirrored) plus the photo: 24 images."""
    from PIL import Image, ImageOps
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    for name in CALIBRATION:
        pixels = getattr(data, name)()
        image = Image.fromarray(pixels[0] if isinstance(pixels, tuple) else pixels).convert("RGB")
        w, h = image.size
        image.save(folder / f"{name}.jpg", quality=90)
        for i, box in enumerate([(0, 0, w * 2 // 3, h * 2 // 3), (w // 3, h // 3, w, h), (w // 4, 0, w * 3 // 4, h // 2)]):
            crop = image.crop(box)
            (ImageOps.mirror(crop) if i == 1 else crop).save(folder / f"{name}_crop{i}.jpg", quality=90)
    return folder


def with_batching(config: dict, dynamic: bool, delay_us: int, bounds: bool, instances: int = 1) -> dict:
    """The config with the sweep's batching: no dynamic batcher (each request runs alone, batch 1), or one
    with this delay, keeping or dropping build-repo's queue bounds (max_queue_size, timeout)."""
    config = to_json(served_config(from_json(config), instances))
    policy = config.get("dynamic_batching", {}).get("default_queue_policy")
    config.pop("dynamic_batching", None)
    if dynamic:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
        if bounds and policy:
            config["dynamic_batching"]["default_queue_policy"] = policy
    return config


def resolved_precision(metrics_url: str, model: str) -> str:
    """The precision the classifier's stub reports on Triton's metrics (classifier_engine_info)."""
    import re

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for labels in re.findall(r"classifier_engine_info\{([^}]*)\} 1", text):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found.get("model") == model:
            return found.get("precision", "?")
    return "?"


def configured(base: dict, variant: str) -> dict:
    """The classifier's config with the variant's engine and precision parameters."""
    engine, _, precision = variant.partition(":")
    config = json.loads(json.dumps(base))
    config.setdefault("parameters", {}).update({"engine": {"string_value": engine},
                                                "precision": {"string_value": precision}})
    return config


def served(url: str, model: str, concurrency: list[int], seconds: float, tensor_path: bool = False,
           side: int = 224) -> dict:
    """Per concurrency: the image path (or the tensor path, `side` pixels square) served, as loadgen measures it."""
    points = {}
    for c in concurrency:
        if tensor_path:
            point = loadgen.run_load(url, model, c, seconds, loadgen.sample(side, batched=True))
        else:
            point = loadgen.run_load(url, names.image_model(model), c, seconds, loadgen.encoded(SAMPLE.read_bytes(), True),
                                     stats_model=model)
        points[str(c)] = {key: value for key, value in point.as_dict().items()
                          if key not in ("config", "concurrency", "engine", "inprocess_same_batch")}
    return points


def measure_variant(client, urls: dict, model_dir: Path, base: dict, variant: str, args, seconds: float) -> dict:
    engine, _, precision = variant.partition(":")
    model = model_dir.name
    loadgen.load_with(client, model, configured(base, variant))
    result = {"variant": variant, "engine": engine, "precision_asked": precision,
              "precision_served": resolved_precision(urls["metrics"], model),
              "served_image": served(urls["http"], model, args.concurrency, seconds)}
    local = InProcess(model_dir, engine, precision)
    short = max(2.0, seconds / 3)
    result["precision_inprocess"] = local.precision
    result["inprocess_images_per_s"] = {str(b): local.measure(b, short) for b in (1, 8)}
    result["inprocess_image_path_same_batch"] = {}
    for c, point in result["served_image"].items():
        batch = max(1, round(point["avg_batch"]))
        rate = local.measure_images(batch, short, SAMPLE.read_bytes())
        result["inprocess_image_path_same_batch"][c] = {"batch": batch, "images_per_s": rate,
                                                        "served_over_inprocess": point["throughput"] / rate}
    del local
    return result


def sweep(client, url: str, model: str, base: dict, pre_base: dict, concurrency, seconds: float) -> list[dict]:
    rows = []
    for label, dynamic, delay, bounds, instances in SWEEP:
        loadgen.load_with(client, names.named(model, "preprocess"), with_batching(pre_base, dynamic, delay, bounds))
        loadgen.load_with(client, model, with_batching(base, dynamic, delay, bounds, instances))
        client.load_model(names.image_model(model))  # the ensemble, after both its steps changed
        side = int(base["input"][0]["dims"][-1])
        for path in ("image", "tensor"):
            for c, point in served(url, model, concurrency, seconds, path == "tensor", side).items():
                rows.append({"config": label, "path": path, "concurrency": int(c), **point})
    loadgen.load_with(client, names.named(model, "preprocess"), pre_base)
    loadgen.load_with(client, model, base)
    return rows


def torchserve_levels(torchserve: dict | None) -> dict:
    """perf.torchserve_bench's levels by concurrency, each with its images_per_s (files before perf.load: img_per_s)."""
    return {level["concurrency"]: {"images_per_s": level.get("img_per_s"), **level}
            for level in (torchserve or {}).get("levels", [])}


def compare(result: dict, torchserve: dict | None) -> None:
    """Ratios within this run (served / in-process) and against TorchServe's levels, per variant."""
    levels = {str(c): level for c, level in torchserve_levels(torchserve).items()}
    for variant in result["variants"]:
        ours = variant["served_image"]
        high, low = max(ours, key=int), min(ours, key=int)
        ratios = {f"served_over_inprocess_c{high}": variant["inprocess_image_path_same_batch"][high]["served_over_inprocess"]}
        if high in levels and low in levels:
            ratios[f"throughput_c{high}_over_torchserve"] = ours[high]["throughput"] / levels[high]["images_per_s"]
            ratios[f"p50_c{low}_over_torchserve"] = ours[low]["p50_ms"] / levels[low]["p50_ms"]
        variant["ratios"] = ratios


def rows(result: dict) -> list[dict]:
    """Every served point as one flat row: the variants' image path, then the sweep."""
    table = [{"variant": v["variant"], "precision": v["precision_served"], "config": "as built", "path": "image",
              "concurrency": int(c), **point} for v in result["variants"] for c, point in v["served_image"].items()]
    sweep_rows = result.get("batching_sweep", {}).get("points", [])
    return table + [{"variant": result["batching_sweep"]["variant"], "precision": "", **row} for row in sweep_rows]


def write_outputs(result: dict, stem: Path) -> list[Path]:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv"), Path(f"{stem}.png")]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    table = rows(result)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    levels = torchserve_levels(result["torchserve"])
    bars = [f"{v['engine']}\n{v['precision_asked']}\n(ran {v['precision_served']})" for v in result["variants"]] + \
        (["TorchServe\n0.12\n(b8, 50 ms)"] if levels else [])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ts_key, c, label in [(axes[0], "throughput", "images_per_s", max, "images / s, concurrency {}"),
                                      (axes[1], "p50_ms", "p50_ms", min, "p50 latency (ms), concurrency {}")]:
        level = c(int(k) for k in result["variants"][0]["served_image"])
        values = [v["served_image"][str(level)][key] for v in result["variants"]]
        values += [levels[level][ts_key]] if level in levels else [0.0] * bool(levels)
        ax.bar(range(len(bars)), values, color=["C0"] * len(result["variants"]) + ["C3"] * bool(levels))
        ax.set_xticks(range(len(bars)), bars, fontsize=7)
        ax.set_ylabel(label.format(level))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{result['model']}, image path (JPEG in), {result['machine']['cpu_model']} "
                 f"({', '.join(result['machine']['isa'])}), {result['machine']['cpus']} cores")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    from builder import cli as build_repo
    from perf.torchserve_bench import cpu_slug
    from server.triton import TritonServer

    args = parser().parse_args(argv)
    model = args.model or ("resnet18" if args.quick else "resnet152")
    variants = args.variants or default_variants(args.quick)
    seconds = args.seconds or (2.0 if args.quick else 15.0)
    stem = args.output / (args.name or f"cpu-engines-{cpu_slug(machine()['cpu_model'])}")
    work = Path(tempfile.mkdtemp(prefix="cpu-engines-"))
    build = ["--model", model, "--weights", "random", "--output", str(work / "repo"), "--force", "--engine", "openvino"]
    try:
        if any(v.endswith(":int8") for v in variants):
            build += ["--precision", "int8", "--calibration", str(calibration_folder(work / "calibration"))]
        return 1 if build_repo.main(build) else run(TritonServer.local(work / "repo", model_control="explicit"),
                                                   work / "repo" / model, variants, seconds, args, argv, stem)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(server, model_dir: Path, variants: list[str], seconds: float, args, argv, stem: Path) -> int:
    """Serve the built repository, measure every variant and the sweep, write the outputs."""
    from clients.classify import model_config
    from server.triton import ServerError
    import tritonclient.http as httpclient

    model = model_dir.name
    torchserve = json.loads(args.torchserve.read_text()) if args.torchserve else None
    result = {"model": model, "weights": "random (seed 0)", "image": f"{SAMPLE.name} ({SAMPLE.stat().st_size} bytes)",
              "machine": machine(), "seconds_per_point": seconds,
              "command": " ".join(["python -m perf.cpu_engines", *(sys.argv[1:] if argv is None else argv)]),
              "clients": "closed loop, threads of this process on the same cores, HTTP, one image per request",
              "torchserve": {"file": args.torchserve.name, "levels": torchserve["levels"]} if torchserve else None,
              "variants": []}
    try:
        server.start()
        urls = {"http": server.http_url, "metrics": f"http://127.0.0.1:{server.ports['metrics']}/metrics"}
        client = httpclient.InferenceServerClient(server.http_url)
        base = model_config(client, model)
        for variant in variants:
            print(f"measuring {variant} ...", file=sys.stderr)
            result["variants"].append(measure_variant(client, urls, model_dir, base, variant, args, seconds))
        if args.sweep:
            print("batching sweep ...", file=sys.stderr)
            result["batching_sweep"] = {"variant": variants[0], "points": sweep(
                client, server.http_url, model, configured(base, variants[0]),
                model_config(client, names.named(model, "preprocess")), args.concurrency, seconds)}
    except (ServerError, RuntimeError, OSError) as exc:
        print(f"perf.cpu_engines: error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    compare(result, torchserve)
    for path in write_outputs(result, stem):
        print(f"wrote {path}")
    for variant in result["variants"]:
        print(variant["variant"], variant["precision_served"],
              {c: round(p["throughput"], 1) for c, p in variant["served_image"].items()},
              {k: round(v, 3) for k, v in variant["ratios"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
