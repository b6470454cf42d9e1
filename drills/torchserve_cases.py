"""TorchServe's own management-API test cases (pytorch/serve's test/postman, kept outside this repository) run by
newman, as TorchServe's regression suite runs them, against TorchServe 0.12 and against serve-repo's TorchServe
front, in one sitting:

    npm install --prefix .cache/newman newman@6
    python -m drills.torchserve_cases --serve-src PATH/TO/serve --out drills/results/torchserve-management-cases.json

PATH/TO/serve: a checkout of pytorch/serve (its test/postman and its examples/image_classifier are read). Each
server starts as TorchServe's `trigger_management_tests` starts it: no model, `--ncs`, config.properties with
`disable_token_authorization=true` and `enable_model_api=true`, a model store holding the archives the cases
register. TorchServe's suite downloads those archives from torchserve.pytorch.org; this machine cannot, so they
are made here from TorchServe's own examples (model.py, handler and labels) with random weights: squeezenet1_1,
densenet161, resnet-18, resnet-152-batch and mnist. A case passes when the status is the one the case expects
(200 unless it says), which is all that TorchServe's collection checks."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.cli import OneLineParser, write_result

ROOT = Path(__file__).resolve().parents[1]
NEWMAN = ROOT / ".cache" / "newman" / "node_modules" / ".bin" / "newman"
COLLECTION, DATA = "management_api_test_collection.json", "management_data.json"
# archive file -> (model name, example folder, model file, torchvision constructor, handler)
ARCHIVES = {
    "squeezenet1_1.mar": ("squeezenet1_1", "squeezenet", "model.py", "squeezenet1_1", "image_classifier"),
    "densenet161.mar": ("densenet161", "densenet_161", "model.py", "densenet161", "image_classifier"),
    "resnet-18.mar": ("resnet-18", "resnet_18", "model.py", "resnet18", "image_classifier"),
    "resnet-152-batch.mar": ("resnet-152-batch", "resnet_152_batch", "model.py", "resnet152", "image_classifier"),
    "mnist.mar": ("mnist", "mnist", "mnist.py", None, "mnist_handler.py"),
}


def make_store(serve_src: Path, store: Path) -> Path:
    """The five archives the cases register, made with torch-model-archiver from TorchServe's examples."""
    import torch
    import torchvision

    from common.model_code import import_model_class
    from perf.torchserve import executables

    examples = serve_src / "examples" / "image_classifier"
    labels = examples / "resnet_18" / "index_to_name.json"
    store.mkdir(parents=True, exist_ok=True)
    for file, (name, folder, model_file, arch, handler) in ARCHIVES.items():
        if (store / file).is_file():
            continue
        src = store.parent / f"{name}-src"
        src.mkdir(exist_ok=True)
        torch.manual_seed(0)
        if arch:  # the example's ImageClassifier is torchvision's architecture: its random weights fit it
            state = getattr(torchvision.models, arch)(weights=None).state_dict()
        else:
            state = import_model_class(examples / folder / model_file, None)().state_dict()
        torch.save(state, src / "weights.pth")
        handler_arg = str(examples / folder / handler) if handler.endswith(".py") else handler
        extra = ["--extra-files", str(labels)] if arch else []
        argv = [executables()["torch-model-archiver"], "--model-name", file.removesuffix(".mar"), "--version", "1.0",
                "--model-file", str(examples / folder / model_file), "--serialized-file", str(src / "weights.pth"),
                "--handler", handler_arg, *extra, "--export-path", str(store), "--force"]
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return store


def newman(cases: Path, management: str, inference: str, report: Path) -> list[dict]:
    """Runs the collection with its data file and environment, as TorchServe's suite does; one entry a case."""
    host, mgmt_port = management.rsplit(":", 1)
    argv = [str(NEWMAN), "run", str(cases / COLLECTION), "-e", str(cases / "environment.json"),
            "-d", str(cases / DATA), "--env-var", f"hostname={host.split('//')[1]}",
            "--env-var", f"mgmt-port={mgmt_port}", "--env-var", f"pred-port={inference.rsplit(':', 1)[1]}",
            "-r", "json", "--reporter-json-export", str(report)]
    subprocess.run(argv, capture_output=True, timeout=3600)
    run = json.loads(report.read_text())["run"]
    data = json.loads((cases / DATA).read_text())
    out = []
    for case, execution in zip(data, run["executions"], strict=True):
        response = execution.get("response") or {}
        failed = [a["assertion"] for a in execution.get("assertions", []) if a.get("error")]
        out.append({"test": case["test"], "call": f"{case['METHOD']} /{case['path']}",
                    "expected": case.get("status_code", 200), "status": response.get("code"),
                    "passed": not failed and bool(response), "body": _body(response)})
    return out


def _body(response: dict) -> str:
    data = (response.get("stream") or {}).get("data") or []
    return bytes(data).decode("utf-8", "replace")[:300]


def torchserve_run(store: Path, folder: Path, cases: Path) -> list[dict]:
    from perf import torchserve

    with torchserve.started(folder, None, workers=None, properties={"enable_model_api": "true"},
                            store=store) as real:
        return newman(cases, real.management_url, real.inference_url, folder / "newman.json")


def ours_run(store: Path, folder: Path, cases: Path) -> list[dict]:
    from perf.serve import TorchServeFront

    front = TorchServeFront(folder, model_store=str(store), enable_model_api="true",
                            disable_token_authorization="true")
    try:
        return newman(cases, front.management_url, front.inference_url, folder / "newman.json")
    finally:
        front.stop()


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m drills.torchserve_cases", description=__doc__)
    p.add_argument("--serve-src", type=Path, required=True, help="a checkout of pytorch/serve")
    p.add_argument("--only", choices=["torchserve", "ours"], help="run one side only (default: both)")
    p.add_argument("--out", type=Path, help="JSON to write. Default: print only.")
    args = p.parse_args(argv)
    if not NEWMAN.is_file():
        p.error(f"newman not found at {NEWMAN.relative_to(ROOT)}: npm install --prefix .cache/newman newman@6")
    cases = args.serve_src / "test" / "postman"
    from perf.bench import machine

    result: dict = {"command": "python -m drills.torchserve_cases --serve-src SERVE " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--serve-src") and
        Path(a) != args.serve_src), "machine": machine(), "cases": f"pytorch/serve test/postman/{DATA}"}
    with tempfile.TemporaryDirectory(prefix="torchserve-cases-") as tmp:
        store = make_store(args.serve_src, Path(tmp) / "archives" / "store")
        for side, run in (("torchserve", torchserve_run), ("ours", ours_run)):
            if args.only and args.only != side:
                continue
            started = time.monotonic()
            copy = shutil.copytree(store, Path(tmp) / side / "store")
            rows = run(copy, Path(tmp) / side, cases)
            result[side] = {"passed": sum(r["passed"] for r in rows), "failed": sum(not r["passed"] for r in rows),
                            "seconds": round(time.monotonic() - started, 1), "rows": rows}
            print(f"{side}: {result[side]['passed']} passed, {result[side]['failed']} failed", file=sys.stderr)
    print(write_result(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
