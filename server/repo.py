"""What a model repository asks of the bundled server: which models it can load, whether it needs a GPU."""
from __future__ import annotations

from pathlib import Path

from common.modelconfig import read_config

# Added when a repository has a KIND_GPU model, unless the same flag is passed through:
# - the CUDA memory pool carries GPU tensors between models (the ensemble's IMAGE: a 64-image batch is
#   38.5 MB as FP32); Triton's default 64 MB holds one such batch, and when it is exhausted
#   the python backend falls back to slower CUDA IPC allocations per tensor;
# - the python backend's shared memory starts at 1 MB per stub and grows 1 MB at a time; a batch of 64
#   images moves ~38 MB through it, so start big enough and grow in large steps.
GPU_FLAGS = ("--cuda-memory-pool-byte-size=0:536870912",
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


def uses_gpu(repository: Path) -> bool:
    for config_path in Path(repository).glob("*/config.pbtxt"):
        try:  # a config Triton cannot parse is reported by Triton itself
            groups = read_config(config_path).instance_group
        except Exception:
            continue
        if any(group.kind == group.KIND_GPU for group in groups):
            return True
    return False


def flag_names(args: list[str]) -> set[str]:
    """`--name` of each flag, and `--backend-config=python,key` for backend settings."""
    names = set()
    for arg in args:
        name, _, value = arg.partition("=")
        names.add(name if name != "--backend-config" else f"{name}={value.split('=')[0]}")
    return names


def gpu_flags(repository: Path, passed: list[str]) -> list[str]:
    """GPU_FLAGS for a repository with GPU models, less those the user passed through."""
    if not uses_gpu(repository):
        return []
    ours = flag_names(passed)
    return [flag for flag in GPU_FLAGS if flag.split("=")[0] not in ours]
