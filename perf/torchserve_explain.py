"""The image path's explanations on the TorchServe front against TorchServe 0.12's own, one sitting (issue 45).

One image_classifier archive (torchvision, random weights seed 0, the last layer scaled by 0.01 as the tests make
them), one photo, loaded at start with 1 worker and batch size 1 on both. Here: the first explanation (its explainer
built and loaded then), later ones, a prediction alone and one sent while an explanation is in flight; on TorchServe
0.12: its explanations; between them: the status, the shape and the largest absolute difference of the attributions.

    python -m perf.torchserve_explain                        # ResNet-18, 3 later explanations
    python -m perf.torchserve_explain --arch resnet152 --repeat 1
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common.cli import OneLineParser, write_result
from perf import torchserve
from perf.samples import CAT
from perf.serve import TorchServeFront
from perf.torchserve_bench import cpu, cpu_slug, versions

NAME = "explained"


def timed(url: str, body: bytes) -> tuple[int, bytes, float]:
    """POST `body`: (status, answer, seconds)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/octet-stream"})
    began = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=900) as reply:
            status, answer = reply.status, reply.read()
    except urllib.error.HTTPError as error:
        status, answer = error.code, error.read()
    return status, answer, time.monotonic() - began


def explanations(inference_url: str, body: bytes, repeat: int) -> tuple[list[float], bytes, list[int]]:
    """The first explanation and `repeat` more: their seconds, the first's answer, every status."""
    answers = [timed(f"{inference_url}/explanations/{NAME}", body) for _ in range(1 + repeat)]
    return [round(t, 3) for _, _, t in answers], answers[0][1], [status for status, _, _ in answers]


def prediction_during(inference_url: str, body: bytes, repeat: int) -> dict:
    """Predictions alone, then one sent 0.25 s into an explanation: their seconds, and whether it came back first."""
    alone = [timed(f"{inference_url}/predictions/{NAME}", body)[2] for _ in range(max(repeat, 3))]
    with ThreadPoolExecutor(1) as pool:
        explaining = pool.submit(timed, f"{inference_url}/explanations/{NAME}", body)
        time.sleep(0.25)
        status, _, during = timed(f"{inference_url}/predictions/{NAME}", body)
        first = not explaining.done()
        explained = explaining.result()[2]
    return {"alone_p50_s": round(statistics.median(alone), 3), "during_explanation_s": round(during, 3),
            "status": status, "answered_before_the_explanation": first, "that_explanation_s": round(explained, 3)}


def run_ours(folder: Path, archive: Path, body: bytes, args) -> tuple[dict, bytes]:
    front = TorchServeFront(folder, "--trust-model-code", timeout=args.start_timeout, model_store=str(archive.parent),
                            load_models=f"{NAME}={archive.name}", disable_token_authorization="true",
                            default_workers_per_model="1")
    try:
        seconds, answer, statuses = explanations(front.inference_url, body, args.repeat)
        loaded = [line for line in front.lines if f"explanations answered by {NAME}_explain" in line]
        return {"explanation_s": seconds, "statuses": statuses, "explainer_loaded": loaded[-1:],
                "prediction": prediction_during(front.inference_url, body, args.repeat)}, answer
    finally:
        front.stop()


def run_torchserve(folder: Path, archive: Path, body: bytes, args) -> tuple[dict, bytes]:
    with torchserve.started(folder, archive, 1, args.start_timeout) as server:
        seconds, answer, statuses = explanations(server.inference_url, body, args.repeat)
        return {"explanation_s": seconds, "statuses": statuses}, answer


def compared(ours: bytes, theirs: bytes) -> dict:
    mine, reference = (np.asarray(json.loads(answer), dtype=np.float64) for answer in (ours, theirs))
    if mine.shape != reference.shape:
        return {"shape": list(mine.shape), "torchserve_shape": list(reference.shape)}
    return {"shape": list(mine.shape), "json_bytes": len(ours), "torchserve_json_bytes": len(theirs),
            "max_abs_difference": float(np.abs(mine - reference).max()),
            "max_abs_attribution": float(np.abs(reference).max()), "byte_identical": ours == theirs}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.torchserve_explain", description=__doc__)
    p.add_argument("--arch", default="resnet18", help="torchvision classifier of the archive. Default: resnet18.")
    p.add_argument("--repeat", type=int, default=3, help="explanations after the first. Default: 3.")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds per server start. Default: 900.")
    p.add_argument("--out", type=Path, help="JSON to write. Default: perf/results/torchserve-explain-CPU.json.")
    args = p.parse_args(argv)
    began = time.monotonic()
    machine = {"cpu": cpu(), **versions(torchserve.executables()["java"])}
    out = args.out or Path("perf/results") / f"torchserve-explain-{cpu_slug(machine['cpu']['model'])}.json"
    body = CAT.read_bytes()
    result = {"machine": machine,
              "command": " ".join(["python -m perf.torchserve_explain", *(sys.argv[1:] if argv is None else argv)]),
              "arch": args.arch, "image": f"{CAT.name} ({len(body)} bytes)"}
    with tempfile.TemporaryDirectory(prefix="ts-explain-") as tmp:
        archive = torchserve.resnet_archive(Path(tmp) / "model_store", NAME, 1, None, 1, arch=args.arch,
                                            fc_scale=0.01)
        result["ours"], ours = run_ours(Path(tmp) / "ours", archive, body, args)
        result["torchserve"], theirs = run_torchserve(Path(tmp) / "torchserve", archive, body, args)
    result["attributions"] = compared(ours, theirs)
    result["took_s"] = round(time.monotonic() - began)
    print(json.dumps({key: result[key] for key in ("ours", "torchserve", "attributions")}, indent=1), file=sys.stderr)
    write_result(result, out)
    print(f"wrote {out} ({result['took_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
