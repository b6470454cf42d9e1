"""Which engine runs which precision on which instance kind: one table for build-repo, the backend and perf.

build-repo copies this file beside the classifier's model.py, so it must stay self-contained (no torch import:
the builder reads it too). The messages name build-repo's flags, since a build is where a precision is chosen.
"""
from __future__ import annotations

# fp32 answers as the same model in eager PyTorch on that device (on a GPU with TF32 convolutions, PyTorch's
# own default there); every other precision is asked for.
DEFAULT = "fp32"
CHOICES = ("auto", "fp32", "fp16", "bf16", "int8")
# engine -> instance kind -> the precisions it runs there. auto and int8 are OpenVINO's: its own choice for the
# serving CPU (bf16 with AMX or AVX512-BF16, else fp32) and the QDQ export quantized at build time.
RUNS = {
    "openvino": {"cpu": ("auto", "fp32", "bf16", "int8"), "gpu": ()},
    "torch": {"cpu": ("fp32", "bf16"), "gpu": ("fp32", "fp16", "bf16")},
    "torchscript": {"cpu": ("fp32", "bf16"), "gpu": ("fp32", "fp16", "bf16")},
    "onnxruntime": {"cpu": ("fp32",), "gpu": ("fp32",)},
}
# The precisions a torch tensor carries, by torch's dtype names (resolved with getattr(torch, name)).
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# OpenVINO's INFERENCE_PRECISION_HINT for each precision it runs; None leaves the choice to OpenVINO.
OPENVINO_HINTS = {"auto": None, "fp32": "f32", "bf16": "bf16", "int8": None}
OPENVINO_RESOLVED = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}  # what OpenVINO chose, in our names
# How far a precision's logits may be from eager fp32's, relative to their largest: fp32 is exact up to
# summation order; bf16 keeps 8 bits of mantissa (ResNet-18 measured ~4e-3). int8 is judged by the accuracy
# gate on real images, not by a tolerance on random inputs.
TOLERANCE = {"fp32": 1e-4, "auto": 3e-2, "bf16": 3e-2}
NATIVE_BF16 = "needs a CPU with AMX or AVX512-BF16 (elsewhere it is emulated, slower than fp32)"


class PrecisionError(ValueError):
    """A precision the engine, the instance kind or the serving CPU does not run."""


def check(precision: str, engine: str, kind: str) -> None:
    """Raise PrecisionError, naming the flag that fixes it, unless `engine` runs `precision` on `kind` instances."""
    if engine not in RUNS:
        raise PrecisionError(f"unknown engine {engine!r}: choose {', '.join(RUNS)}")
    if engine == "openvino" and kind == "gpu":
        raise PrecisionError("--engine openvino runs on CPU instances: use --kind cpu")
    if precision not in CHOICES:
        raise PrecisionError(f"unknown precision {precision!r}: choose {', '.join(CHOICES)}")
    if precision in RUNS[engine][kind]:
        return
    if engine == "openvino":
        raise PrecisionError(f"--precision {precision} is not one OpenVINO runs here: "
                             f"{', '.join(RUNS['openvino']['cpu'])}")
    if precision in RUNS["openvino"]["cpu"] and precision not in RUNS["torch"]["gpu"]:
        raise PrecisionError(f"--precision {precision} needs --engine openvino (on CPU instances)")
    if kind == "cpu" and precision in RUNS[engine]["gpu"]:
        raise PrecisionError(f"--precision {precision} needs --kind gpu; on CPU, engine {engine} runs "
                             f"{' or '.join(RUNS[engine]['cpu'])} (bf16 where the serving CPU has AMX or AVX512-BF16)")
    raise PrecisionError(f"--precision {precision} needs --engine torch or torchscript "
                         f"(engine {engine} runs {' or '.join(RUNS[engine][kind])})")


def served(precision: str, engine: str) -> str:
    """The precision a recorded one means for `engine`: auto is the engine's own choice, which is fp32 for
    every engine but OpenVINO (older repositories recorded auto for every engine)."""
    return "fp32" if precision == "auto" and engine != "openvino" else precision


def check_native(precision: str, native_bf16: bool) -> None:
    """Refuse bf16 on a CPU that would only emulate it (checked where the model loads: the serving CPU)."""
    if precision == "bf16" and not native_bf16:
        raise PrecisionError(f"precision bf16 {NATIVE_BF16}: serve this model with precision fp32, "
                             "or engine openvino with precision auto")


def summary() -> str:
    """RUNS in words, for --help: "openvino on CPU: auto, fp32, bf16, int8; torch on CPU: fp32, bf16, ..."."""
    return "; ".join(f"{engine} on {kind.upper()}: {', '.join(runs)}"
                     for engine, kinds in RUNS.items() for kind, runs in kinds.items() if runs)
