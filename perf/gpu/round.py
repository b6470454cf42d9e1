"""The whole GPU round in one bounded call: python -m perf.gpu.round --out DIR [--dry-run].

Each step runs in a process of its own (python -m perf.gpu.steps) under a time limit, so that a crash
or a hang in CUDA ends that step only. Its outcome -- ok, failed with a reason, or skipped with a
reason -- and what it learned go to DIR/round.json, rewritten after every step (a call cut short keeps
what was learned). DIR/gpu-resnet152.json holds the figures under stable keys (perf/results/ keeps the
committed copy); every log (each step's, each tritonserver's, the tests' output) is packed into
DIR/logs.tar.gz after every step, so that DIR stays a handful of files (a device call returns 8 at most).

Steps, in this order by default (the bench runs alone on the GPU; gpu_tests runs beside the steps after it, up to the
next timing; one run of at most 540 s on the GPU machine):
  environment           Python/torch/CUDA versions, GPU, driver, kernel, /dev/shm, CPU, the stubs' Python and its
                        numpy, how libcuda resolves, ldd of the wheel's stub
  bench                 ResNet-152 served per precision with CUDA graphs, each point beside the same engine with the batch
                        already on the GPU (served_over_inprocess) and the backend's own split of each execute
                        (stage_timing), then the JPEG path; each client reads its first answers (an empty or non-finite
                        one is an error)
  engine                the engine alone, batch on the GPU: per precision, eager and CUDA graphs, b64 / b128 / b256
  gpu_tests             pytest on the GPU test files (perf.gpu.checks.GPU_TESTS): passed / failed counts
  instance_io           only when the bench's answers were wrong (or --diagnose always): resnet18's answers (tensor
                        and JPEG) served in each way of perf.gpu.io_variants.IO_VARIANTS
  gpu_output            an echo model on a GPU instance answering with a CUDA tensor: without serve-repo's
                        libcuda.so link, then as serve-repo starts tritonserver
  image_path            a JPEG to resnet18_image over gRPC: fused (the GPU default), ensemble CPU / GPU decode
  parity                nvJPEG + GPU transforms vs PIL on perf.samples' JPEGs
  instances             the best precision with 1 and 2 classifier instances at c=256 (the bench ran build-repo's 4)
  compile               conv-BN folding, CUDA graphs, torch.compile in-process (perf.gpu.compile); not in the default
                        round (its warm-up takes minutes): --steps compile
  python_backend_probe  echo models vs resnet18: the python backend's own ceiling

--dry-run: the same steps with the CPU standing in (resnet18, short points, tens of seconds each), the
wiring proven without a GPU (tests/test_gpu_round.py). Without --dry-run and without CUDA the GPU steps
are skipped, saying so.

On the bare GPU machine (no package registry, NumPy 2 in its Python): tools/gpu_carry.sh, here, packs .gpucarry/
to carry; there tools/gpu_round.sh OUT runs this with the carry unpacked and the stubs given a Python with NumPy 1.x
(tools/stub_env.sh; docs/performance.md, "The GPU round"). The suite runs the same script with perf.gpu.standin's
stand-in for that machine's Python (tests/test_gpu_round.py).

Exit status: 0 when no step failed, 1 when one did (round.json says which and why), 2 for bad arguments.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from common.cli import OneLineParser
from perf.stats import STAGES
from perf.gpu.steps import DEFAULT_STEPS, ROOT, STEPS, result_path, run_bounded

GRACE_S = 20  # after SIGTERM, time for a step to stop its servers and write what it has
MIN_STEP_S = 15  # less than this left in the budget (and asked for): the step is skipped rather than started
BACKGROUND = ("gpu_tests",)  # run beside the steps that follow it, up to the first ALONE step
ALONE = ("bench", "engine", "instances", "compile", "python_backend_probe")  # timings: nothing else on the GPU meanwhile
# Each step's own limit (seconds) on the GPU; a dry run's steps are small and get the same.
LIMITS = {"environment": 60, "instance_io": 200, "gpu_tests": 300, "gpu_output": 90, "image_path": 150, "parity": 60, "bench": 230,
          "engine": 90, "instances": 120, "compile": 240, "python_backend_probe": 60}
RESULT = "gpu-resnet152.json"
HEADLINE = ("round.json", RESULT, "gpu_tests.txt")  # copied into DIR as they are; the rest goes into logs.tar.gz
# Run in a child so that a CUDA driver that hangs or crashes on init cannot take this process with it.
_CUDA_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'available': ok, "
               "'devices': torch.cuda.device_count() if ok else 0, 'torch': torch.__version__}))")


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m perf.gpu.round", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True,
                   help="folder for round.json, gpu-resnet152.json, gpu_tests.txt and logs.tar.gz (created). "
                        "Default: none (required).")
    p.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(DEFAULT_STEPS), metavar="STEP",
                   help=f"steps to run, in the order given ({', '.join(STEPS)}). Default: all but compile.")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="longest one step may run, in seconds: then it gets SIGTERM, and SIGKILL to its process "
                        f"group {GRACE_S} s later, and is recorded as failed. Default: each step's own "
                        f"({', '.join(f'{k} {v}' for k, v in LIMITS.items())}).")
    p.add_argument("--budget-s", type=float, default=540,
                   help="all steps together, in seconds (a device call is limited to 600): a step gets at most "
                        "what is left, and is skipped when too little is. Default: 540.")
    p.add_argument("--diagnose", choices=("on-failure", "always"), default="on-failure",
                   help="instance_io (which way of serving answers right): on-failure runs it only when the bench "
                        "failed or did not run. Default: on-failure.")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU stands in for the GPU: the same steps on a small model, in seconds each. "
                        "Default: off.")
    return p


def probe_cuda(work: Path) -> dict:
    log = work / "cuda_probe.log"
    status = run_bounded([sys.executable, "-c", _CUDA_PROBE], log, 120, grace=5, cwd=ROOT)
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    try:
        found = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = lines[-1][:300] if lines else "no output"
        return {"available": False, "error": f"the probe {'timed out' if status is None else 'failed'}: {tail}",
                "reason": "no CUDA: the probe failed (cuda_probe.log)"}
    if not found["available"]:
        found["reason"] = f"no CUDA: torch.cuda.is_available() is False (torch {found['torch']})"
    return found


def run_step(step: str, work: Path, limit: float, dry_run: bool) -> dict:
    """One step in a child process, bounded: its own outcome, or failed with why it gave none."""
    result_path(work, step).unlink(missing_ok=True)
    begin = time.monotonic()
    cmd = [sys.executable, "-m", "perf.gpu.steps", step, str(work), "--timeout-s", f"{limit:g}"]
    status = run_bounded(cmd + (["--dry-run"] if dry_run else []), work / f"{step}.log", limit, grace=GRACE_S,
                         cwd=ROOT)
    try:
        outcome = json.loads(result_path(work, step).read_text())
        result_path(work, step).unlink()
    except (OSError, ValueError):
        outcome = {"status": "failed", "details": {}}
        if status is not None:  # it died before writing: a crash (a negative status is the killing signal)
            outcome["reason"] = f"the step's process exited with status {status} and no result; see {step}.log"
    if status is None:
        outcome.update(status="failed", reason=f"timed out after {limit:g} s")
    outcome.update(seconds=round(time.monotonic() - begin, 1), log=f"{step}.log")
    return outcome


def _count(summary: str, word: str) -> int:
    found = re.search(rf"(\d+) {word}", summary)
    return int(found.group(1)) if found else 0


def figures(report: dict, work: Path) -> dict:
    """gpu-resnet152.json: the issue's keys (None where not measured), then the bench's own record."""
    steps = report["steps"]
    env = steps.get("environment", {}).get("details", {})
    tests = steps.get("gpu_tests", {}).get("details", {})
    summary = tests.get("summary", "")
    bench_file = work / "bench.json"
    bench = json.loads(bench_file.read_text()) if bench_file.exists() else {}
    instances = steps.get("instances", {}).get("details", {})
    engine_file = work / "engine.json"
    engine = json.loads(engine_file.read_text())["points"] if engine_file.exists() else None
    best_point = _best_point(bench)
    device = bench.get("device") or env.get("gpu") or ("cpu (dry run)" if report["dry_run"] else None)
    return {
        "device": device,
        "driver": env.get("nvidia_smi"), "torch": env.get("torch"), "cpu": env.get("cpu"),
        "dry_run": report["dry_run"], "command": report["command"], "started": report["started"],
        "served_images_per_s": bench.get("served_images_per_s"),
        "served_over_inprocess": bench.get("served_over_inprocess"),
        "inprocess_images_per_s": best_point.get("inprocess_images_per_s"),
        "served_over_runner_from_host": best_point.get("served_over_runner_from_host"),
        "served_p99_ms": best_point.get("p99_ms"),
        "c1_p50_ms": _c1_p50(bench),
        "jpeg_images_per_s": bench.get("jpeg_images_per_s"),
        "jpeg_over_tensor": bench.get("jpeg_over_tensor"),
        "gpu_tests_passed": _count(summary, "passed") if summary else None,
        "gpu_tests_failed": _count(summary, "failed") + _count(summary, "error") if summary else None,
        "gpu_tests_skipped": _count(summary, "skipped") if summary else None,
        "steps": {name: outcome["status"] for name, outcome in steps.items()},
        "best": bench.get("best"), "instances": instances.get("points"),
        # Where the best point's time went: the backend's split of one execute (ms) beside Triton's per request.
        "execute_split_ms": best_point.get("execute_split_ms"),
        "triton_split_ms": {stage: best_point.get(f"{stage}_ms") for stage in STAGES} if best_point else None,
        "jpeg_execute_split_ms": max(bench.get("jpeg", []), key=lambda p: p["images_per_s"], default={}).get(
            "execute_split_ms"),
        "engine": engine,
        "compile_over_graph": steps.get("compile", {}).get("details", {}).get("compile_over_graph"),
        "bench": bench,
    }


def _best_point(bench: dict) -> dict:
    """The tensor path's fastest point (the one served_images_per_s names), or {}."""
    points = [point for entry in bench.get("tensor", []) for point in entry["points"]]
    return max(points, key=lambda point: point["images_per_s"], default={})


def _c1_p50(bench: dict) -> dict | None:
    """p50 at concurrency 1 per precision (graphs as run), ms."""
    found = {f"{e['precision']}{'+graphs' if e['cuda_graphs'] else ''}": round(p["p50_ms"], 2)
             for e in bench.get("tensor", []) for p in e["points"] if p["concurrency"] == 1}
    return found or None


def pack(report: dict, work: Path, out: Path) -> None:
    """DIR gets round.json, gpu-resnet152.json and the tests' output as files, everything else in logs.tar.gz."""
    (work / "round.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (work / RESULT).write_text(json.dumps(figures(report, work), indent=2, default=str) + "\n")
    for name in HEADLINE:
        if (work / name).exists():
            shutil.copyfile(work / name, out / name)
    partial = out / "logs.tar.gz.part"
    with tarfile.open(partial, "w:gz") as archive:
        for path in sorted(work.iterdir()):
            if path.name not in HEADLINE:
                try:
                    archive.add(path, arcname=f"logs/{path.name}")
                except OSError:  # a server's log that vanished meanwhile
                    pass
    partial.replace(out / "logs.tar.gz")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"perf.gpu.round: cannot create {out}: {exc.strerror}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-round-"))  # many files; DIR gets them packed
    deadline = time.monotonic() + args.budget_s
    report = {"command": " ".join(["python -m perf.gpu.round", *(sys.argv[1:] if argv is None else argv)]),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dry_run": args.dry_run,
              "cuda": {}, "steps": {}}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            pack(report, work, out)

    def record(step: str, outcome: dict) -> None:
        with lock:
            report["steps"][step] = outcome
        save()
        print(f"{step}: {outcome['status']}" + (f" ({outcome['reason']})" if outcome.get("reason") else ""),
              f"[{outcome.get('seconds', 0)} s]", flush=True)

    def outcome_of(step: str) -> dict | None:
        """Skipped (with why) before it starts, or None when it may run."""
        if STEPS[step][2] and not cuda["available"] and not args.dry_run:
            return {"status": "skipped", "reason": cuda["reason"]}
        if step == "instance_io" and args.diagnose == "on-failure" \
                and report["steps"].get("bench", {}).get("status") == "ok":
            return {"status": "skipped", "reason": "the bench's answers were right (--diagnose always runs it)"}
        if deadline - time.monotonic() - GRACE_S < min(limit_of(step), MIN_STEP_S):
            return {"status": "skipped", "reason": f"no time left in --budget-s {args.budget_s:g}"}
        return None

    def limit_of(step: str) -> float:
        return min(args.timeout_s or LIMITS[step], max(1.0, deadline - time.monotonic() - GRACE_S))

    cuda = report["cuda"] = probe_cuda(work)
    save()
    background: list[threading.Thread] = []
    for step in args.steps:
        if step in ALONE:
            for thread in background:  # the timings run with nothing else on the GPU
                thread.join()
            background.clear()
        skipped = outcome_of(step)
        if skipped is not None:
            record(step, skipped)
        elif step in BACKGROUND:
            limit = limit_of(step)
            thread = threading.Thread(target=lambda s=step, l=limit: record(s, run_step(s, work, l, args.dry_run)))
            thread.start()
            background.append(thread)
        else:
            record(step, run_step(step, work, limit_of(step), args.dry_run))
    for thread in background:
        thread.join()
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")
    failed = "error" in cuda or any(o["status"] == "failed" for o in report["steps"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
