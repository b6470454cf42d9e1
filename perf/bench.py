"""Benchmark batching configs over a concurrency sweep, served vs the same engine in-process."""
from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from common.cli import OneLineParser
from perf import loadgen
from perf.load import in_process
from clients.classify import model_config

# (label, max_batch_size, max_queue_delay_us); "default" is what build-repo ships.
FULL_CONFIGS = [("unbatched", 0, 0), ("default b8 d0", 8, 0), ("b8 d20ms", 8, 20_000), ("b16 d0", 16, 0)]
QUICK_CONFIGS = [("unbatched", 0, 0), ("default b8 d0", 8, 0)]


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m perf.bench", description=__doc__)
    p.add_argument("--url", help="a running server in explicit model-control mode. "
                                 "Default: build a repository and start serve-repo.")
    p.add_argument("--model", default=None, help="model to bench. Default: resnet152 (resnet18 with --quick).")
    p.add_argument("--weights", default="random",
                   help="weights when building (speed does not depend on their values; auto: the pretrained ones, "
                        "which build-repo cannot get offline). Default: random.")
    p.add_argument("--repository", type=Path, default=None,
                   help="with --url: the served repository, to run the same engine in-process. "
                        "Default: a temporary one the bench builds.")
    p.add_argument("--engines", nargs="+", choices=("torch", "torchscript", "onnxruntime", "openvino"), default=None,
                   help="backend engines to compare on one server. Default: the one build-repo picks.")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="clients in flight. Default: 1 2 4 8 16 32 (1 4 8 with --quick).")
    p.add_argument("--seconds", type=float, default=None, help="measurement per point. Default: 20 (4 quick).")
    p.add_argument("--configs", nargs="+", default=None,
                   help="configs as LABEL=MAXBATCH:DELAY_US, e.g. 'b8 d2ms=8:2000'. Default: a built-in set.")
    p.add_argument("--output", type=Path, default=Path("perf/results/latest"),
                   help="directory (or path prefix) for JSON, CSV and PNGs. Default: perf/results/latest.")
    p.add_argument("--name", default=None, help="file stem. Default: cpu-MODEL or gpu-MODEL.")
    p.add_argument("--quick", action="store_true", help="resnet18, 2 configs, 3 concurrencies: < 2 min.")
    return p


def _configs(args) -> list[tuple[str, int, int]]:
    if not args.configs:
        return QUICK_CONFIGS if args.quick else FULL_CONFIGS
    parsed = []
    for item in args.configs:
        label, _, spec = item.rpartition("=")
        size, _, delay = spec.partition(":")
        parsed.append((label or spec, int(size), int(delay or 0)))
    return parsed


class InProcess:
    """The very runner the backend builds (backends/classifier.py build_runner), run here with no server."""

    def __init__(self, model_dir: Path, engine: str, precision: str | None = None):
        import torch

        from backends.batch_runner import PRECISIONS
        from backends.classifier import build_runner
        from common.modelconfig import parameters, read_config
        from common.transforms import transform_from_parameters

        config = read_config(model_dir)
        params = {**parameters(config), "engine": engine, **({"precision": precision} if precision else {})}
        self.side = int(config.input[0].dims[-1])
        self.runner = build_runner(model_dir / "1", params, torch.device("cpu"), max(config.max_batch_size, 1),
                                   (3, self.side, self.side))
        self.runner.warm_up()
        # What the engine runs: OpenVINO resolves precision auto here, as it does in the stub.
        names = {dtype: name for name, dtype in PRECISIONS.items()}
        self.precision = getattr(self.runner.engine, "precision", None) or names[self.runner.dtype]
        self.transform = transform_from_parameters(params)
        self.rates: dict[int, list[float]] = {}
        self.image_rates: dict[int, list[float]] = {}

    def measure(self, batch: int, seconds: float) -> float:
        """Images/s at `batch`; measured right after each served point, so both see the same machine."""
        import torch

        images = torch.from_numpy(np.stack([loadgen.sample(self.side, False)] * batch))
        rate = in_process(lambda: self.runner.run([images]), batch, seconds, min_runs=2)
        self.rates.setdefault(batch, []).append(rate)
        return rate

    def measure_images(self, batch: int, seconds: float, data: bytes) -> float:
        """Images/s of the image path's whole work at `batch`: decode, preprocess (the preprocess stub's
        own code) and the forward, one after another on these cores."""
        import torch

        from backends.preprocess import Preprocessor

        preprocess = Preprocessor(self.transform, torch.device("cpu"), tensor_decode=False)
        rate = in_process(lambda: self.runner.run([torch.stack(preprocess([data] * batch))]), batch, seconds, min_runs=2)
        self.image_rates.setdefault(batch, []).append(rate)
        return rate



def add_engine_artifacts(model_dir: Path, engines: list[str]) -> None:
    """Put every engine's artifact in the bench repository so one server can switch engines live."""
    import torch

    from backends.engines import load_engine
    from builder import export
    from common.modelconfig import parameters, read_config

    params = parameters(read_config(model_dir))
    module = load_engine(model_dir / "1", {**params, "engine": "torch"}, torch.device("cpu"),
                          torch.contiguous_format, 0)
    side = int(read_config(model_dir).input[0].dims[-1])
    if {"onnxruntime", "openvino"} & set(engines) and not (model_dir / "1" / "model.onnx").exists():
        export.export_onnx(module, model_dir / "1" / "model.onnx", side)
    if "torchscript" in engines and not (model_dir / "1" / "model.pt").exists():
        export.export_torchscript(module, model_dir / "1" / "model.pt", side)


def sweep(url: str, model: str, engines: list[str], configs, concurrency: list[int], seconds: float,
          progress, inprocess: dict[str, InProcess]) -> list[loadgen.Point]:
    client = httpclient.InferenceServerClient(url)
    base = model_config(client, model)
    side = int(base["input"][0]["dims"][-1])
    points = []
    try:
        for engine in engines:
            for label, size, delay in configs:
                config = loadgen.batching_override(base, size, delay)
                config.setdefault("parameters", {})["engine"] = {"string_value": engine}
                loadgen.load_with(client, model, config)
                image = loadgen.sample(side, batched=size > 0)
                name = label if len(engines) == 1 else f"{engine} {label}"
                for c in concurrency:
                    progress.set_description(f"{name} c={c}")
                    point = loadgen.run_load(url, model, c, seconds, image, label=name)
                    point.engine = engine
                    if engine in inprocess and point.avg_batch > 0:  # the server idles meanwhile
                        point.inprocess_same_batch = inprocess[engine].measure(
                            max(1, round(point.avg_batch)), max(2.0, seconds / 3))
                    points.append(point)
                    progress.update(1)
    finally:
        loadgen.load_with(client, model, base)  # leave the server as we found it
    return points


def summarize(points: list[loadgen.Point], configs, engines: list[str]) -> dict:
    """The headline ratios, each from numbers measured in this one run."""
    single = len(engines) == 1
    default = next((label for label, size, _ in configs if label.startswith("default")), None)
    batched = default or next(label for label, size, _ in configs if size > 0)
    summary, per_engine = {}, {}
    for engine in engines:
        name = (lambda label: label) if single else (lambda label, e=engine: f"{e} {label}")
        by = {(p.config, p.concurrency): p for p in points if p.engine == engine}
        ratios = {}
        c8, one = by.get((name(batched), 8)), by.get((name("unbatched"), 1))
        if c8 and c8.inprocess_same_batch:
            ratios["inprocess_batch_c8"] = max(1, round(c8.avg_batch))
            ratios["served_over_inprocess_c8"] = c8.throughput / c8.inprocess_same_batch
            if (name("unbatched"), 8) in by:
                ratios["batched_over_unbatched_c8"] = c8.throughput / by[(name("unbatched"), 8)].throughput
        if one and default and (name(default), 1) in by:
            ratios["p50_c1_default_over_unbatched"] = by[(name(default), 1)].p50_ms / one.p50_ms
        if one and one.inprocess_same_batch:
            ratios["served_over_inprocess_c1_unbatched"] = one.throughput / one.inprocess_same_batch
        per_engine[engine] = ratios
    summary.update(per_engine[engines[0]])  # the headline is the first (shipped) engine's
    if not single:
        summary["per_engine"] = per_engine
    return summary


def write_outputs(result: dict, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv")]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result["points"][0]))
        writer.writeheader()
        writer.writerows(result["points"])
    return paths + plot(result, stem)


def plot(result: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(p["config"] for p in result["points"]))
    paths = []
    for suffix, x_key, y_key, xlabel, ylabel, logx in [
        ("-throughput.png", "concurrency", "throughput", "concurrent clients", "images / s", True),
        ("-latency.png", "throughput", "p99_ms", "images / s", "p99 latency (ms)", False),
    ]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for config in configs:
            rows = [p for p in result["points"] if p["config"] == config]
            ax.plot([r[x_key] for r in rows], [r[y_key] for r in rows], marker="o", label=config)
        if suffix == "-throughput.png":
            for engine, by_batch in result["inprocess_images_per_s"].items():
                for batch, rate in by_batch.items():
                    ax.axhline(rate, linestyle=":", color="grey", linewidth=1)
                    ax.annotate(f"in-process {engine} b={batch}", (1, rate), fontsize=7, color="grey")
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['model']} on {result['machine']['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(str(stem) + suffix)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def machine() -> dict:
    import torch
    import tritonclient

    return {"device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
            "cpu_model": cpuinfo("model name"), "isa": _isa(), "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "tritonclient": getattr(tritonclient, "__version__", "?"), "platform": platform.platform()}


# The CPU features that decide which engine and precision are fastest (README, engines).
ISA_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def cpuinfo(field: str) -> str:
    """A /proc/cpuinfo field, as the backend reads it (backends.engines.cpuinfo); "?" for an unknown CPU model."""
    from common.cpu import cpuinfo as read

    return read(field) or (platform.processor() or "?" if field == "model name" else "")


def _isa() -> list[str]:
    flags = set(cpuinfo("flags").split())
    return [flag for flag in ISA_FLAGS if flag in flags]


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from builder import cli as build_repo
    from server.triton import ServerError, TritonServer

    args = parser().parse_args(argv)
    model = args.model or ("resnet18" if args.quick else "resnet152")
    concurrency = args.concurrency or ([1, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32])
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    configs = _configs(args)
    stem = args.output / (args.name or f"{'cpu' if machine()['device'] == 'cpu' else 'gpu'}-{model}")
    server = None
    repo = args.repository or Path(tempfile.mkdtemp(prefix="bench-")) / "repo"
    try:
        if args.url:
            url = args.url
        else:
            build = ["--model", model, "--weights", args.weights, "--output", str(repo), "--force"]
            if build_repo.main(build + (["--engine", args.engines[0]] if args.engines else [])):
                return 1
            server = TritonServer.local(repo, model_control="explicit")
        model_dir = repo / model
        engines = args.engines or [_served_engine(model_dir)]
        if server is not None:
            add_engine_artifacts(model_dir, engines)
            url = server.start().http_url
        inprocess = {e: InProcess(model_dir, e) for e in engines} if model_dir.exists() else {}
        with tqdm(total=len(engines) * len(configs) * len(concurrency), unit="point", file=sys.stderr) as bar:
            points = sweep(url, model, engines, configs, concurrency, seconds, bar, inprocess)
    except (ServerError, RuntimeError, OSError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
        if not args.repository:
            shutil.rmtree(repo.parent, ignore_errors=True)  # the repository it built for this run
    result = {"model": model, "engines": engines, "seconds_per_point": seconds,
              "configs": [list(c) for c in configs], "machine": machine(),
              "command": " ".join(["python -m perf.bench", *(argv if argv is not None else sys.argv[1:])]),
              **summarize(points, configs, engines),
              "inprocess_images_per_s": {e: {str(b): float(np.mean(r)) for b, r in sorted(ip.rates.items())}
                                         for e, ip in inprocess.items()},
              "points": [p.as_dict() for p in points]}
    for path in write_outputs(result, stem):
        print(f"wrote {path}")
    for key in ("served_over_inprocess_c8", "batched_over_unbatched_c8", "p50_c1_default_over_unbatched"):
        if key in result:
            print(f"{key} = {result[key]:.3f}")
    return 0


def _served_engine(model_dir: Path) -> str:
    from common.modelconfig import parameters, read_config

    return parameters(read_config(model_dir)).get("engine", "torch")


if __name__ == "__main__":
    sys.exit(main())
