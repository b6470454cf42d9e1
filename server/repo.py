"""What a model repository asks of the bundled server: which models it can load, whether it needs a GPU."""
from __future__ import annotations

import subprocess
from pathlib import Path

from common.modelconfig import read_config

# Added when a repository has a KIND_GPU model, unless the same flag is passed through:
# - the CUDA memory pool carries GPU tensors between models (the ensemble's IMAGE: a 64-image batch is
#   38.5 MB as FP32); Triton's default 64 MB holds one such batch, and when it is exhausted
#   the python backend falls back to slower CUDA IPC allocations per tensor;
# - the python backend's shared memory starts at 1 MB per stub and grows 1 MB at a time; a batch of 64
#   images moves ~38 MB through it, so start big enough and grow in large steps.
POOL_BYTES = 536870912
GPU_FLAGS = (f"--cuda-memory-pool-byte-size=0:{POOL_BYTES}",
             "--backend-config=python,shm-default-byte-size=67108864",
             "--backend-config=python,shm-growth-byte-size=67108864")


def servable_models(repository: Path) -> tuple[list[str], dict[str, str]]:
    """Models the bundled server can load (python backend, ensembles), and why the others cannot."""
    loadable, skipped = [], {}
    for config_path in sorted(Path(repository).glob("*/config.pbtxt")):
        name = config_path.parent.name
        try:
            config = read_config(config_path)
        except Exception:  # let Triton itself report a config it cannot parse
            loadable.append(name)
            continue
        if config.backend == "python" or config.platform == "ensemble":
            loadable.append(name)
        else:
            skipped[name] = (f"{config.platform or config.backend} needs NVIDIA's Triton container "
                             "(docker/); the nvidia-pytriton server has only the python backend")
    return loadable, skipped


def compile_bytecode(repository: Path) -> list[Path]:
    """Bytecode of every python model, for this interpreter (the stub's: server/wheel.py picks the stub of
    the same Python), written before Triton loads them. A stub that writes __pycache__ at its first load makes
    Triton count the version as modified, and every later load of it (serve-repo replacing a dead stub) a whole
    new copy of the model instead of an update of one instance; build-repo compiles with its own Python, which
    may not be this one. Returns the version folders where something was written; a read-only repository is
    left as it is."""
    import compileall
    import sys

    written = []
    for model in sorted(Path(repository).glob("*/*/model.py")):
        folder = model.parent
        cached = folder / "__pycache__" / f"model.{sys.implementation.cache_tag}.pyc"
        if cached.is_file() and cached.stat().st_mtime >= model.stat().st_mtime:
            continue
        try:
            if compileall.compile_dir(folder, quiet=2, maxlevels=0) and cached.is_file():
                written.append(folder)
        except OSError:
            continue
    return written


def fingerprint(model_dir: Path) -> tuple:
    """What a model folder holds (path, size, mtime of each file; bytecode aside): build-repo --force replaces
    every file, so a different fingerprint means a new build, not the one Triton loaded."""
    files = []
    for path in sorted(Path(model_dir).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            stat = path.stat()
            files.append((path.relative_to(model_dir).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(files)


def in_flight(repository: Path, least: int = 8) -> int:
    """How many inference requests the proxy lets reach Triton at once for `repository`: enough to fill the
    largest model's instances twice over (a batch running on each, the next one forming in Triton's dynamic
    batcher; ensembles only route), and `least` at least. The rest wait in the proxy's queue, where overload is
    refused at once instead of piling up in Triton's unbounded one: every request let in beyond this only waits
    longer inside Triton."""
    largest = 0
    for config_path in Path(repository).glob("*/config.pbtxt"):
        try:
            config = read_config(config_path)
        except Exception:  # noqa: BLE001 - Triton itself reports a config it cannot parse
            continue
        if config.platform == "ensemble":
            continue
        instances = sum(max(1, group.count) for group in config.instance_group) or 1
        largest = max(largest, 2 * max(1, config.max_batch_size) * instances)
    return max(least, largest)


def uses_gpu(repository: Path) -> bool:
    for config_path in Path(repository).glob("*/config.pbtxt"):
        try:  # a config Triton cannot parse is reported by Triton itself
            config = read_config(config_path)
        except Exception:
            continue
        # KIND_GPU instances, or CPU instances whose model runs on a GPU (config parameter cuda_device)
        if any(group.kind == group.KIND_GPU for group in config.instance_group) or "cuda_device" in config.parameters:
            return True
    return False


def flag_names(args: list[str]) -> set[str]:
    """`--name` of each flag, and `--backend-config=python,key` for backend settings."""
    names = set()
    for arg in args:
        name, _, value = arg.partition("=")
        names.add(name if name != "--backend-config" else f"{name}={value.split('=')[0]}")
    return names


def gpu_count() -> int:
    """GPUs the NVIDIA driver shows (its /proc folder, else nvidia-smi), at least 1: no torch import here."""
    try:
        return max(1, len(list(Path("/proc/driver/nvidia/gpus").iterdir())))
    except OSError:
        pass
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))
    except (OSError, subprocess.SubprocessError):
        return 1


def gpu_flags(repository: Path, passed: list[str], gpus: int | None = None) -> list[str]:
    """GPU_FLAGS for a repository with GPU models, the memory pool for every GPU (Triton's flag is per device:
    GPU 0's alone left the others at the default 64 MB), less the flags the user passed through."""
    if not uses_gpu(repository):
        return []
    ours = flag_names(passed)
    pools = [f"--cuda-memory-pool-byte-size={i}:{POOL_BYTES}" for i in range(1, gpus or gpu_count())]
    # By name: a python backend setting passed through (--backend-config=python,KEY=...) replaces ours for KEY.
    return [flag for flag in (*GPU_FLAGS, *pools) if not flag_names([flag]) & ours]
