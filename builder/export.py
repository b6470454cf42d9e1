"""Export a classifier to ONNX and TorchScript with fixed tensor names, and check them against eager."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from common.contract import IMAGE as INPUT, LOGITS as OUTPUT
from common.precision import OPENVINO_HINTS, TOLERANCE as TOLERANCES
# The LibTorch backend binds inputs by forward() argument name, outputs by `<name>__<index>`.
TORCHSCRIPT_OUTPUT = f"{OUTPUT}__0"
ONNX_OPSET = 17
TOLERANCE = TOLERANCES["fp32"]
BF16_TOLERANCE = TOLERANCES["bf16"]


class ExportError(RuntimeError):
    """An export failed or does not match eager torch."""


class _Named(torch.nn.Module):
    """Gives forward() the argument name IMAGE, which TorchScript keeps and LibTorch binds by."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, IMAGE: torch.Tensor) -> torch.Tensor:  # noqa: N803 - the tensor's served name
        return self.model(IMAGE)


def export_onnx(model: torch.nn.Module, path: Path, side: int) -> Path:
    import onnx

    example = torch.zeros(2, 3, side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (example,), str(path), input_names=[INPUT], output_names=[OUTPUT],
                          dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}}, opset_version=ONNX_OPSET,
                          dynamo=False)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{path} fails onnx.checker: {exc}") from exc
    return path


def export_torchscript(model: torch.nn.Module, path: Path, side: int) -> Path:
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(_Named(model.eval()), torch.zeros(2, 3, side, side))
    traced.save(str(path))
    return path


def run_openvino(path: Path, batch: np.ndarray, precision: str = "auto") -> np.ndarray:
    """The model as the openvino engine runs it: `precision` as the config records it (auto and int8: OpenVINO's
    own choice for this CPU; fp32 and bf16: asked for, as backends/engines.py asks)."""
    import openvino as ov

    hint = OPENVINO_HINTS.get(precision)
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": hint} if hint else {})
    return compiled([batch])[compiled.output(0)]


def run_onnx(path: Path, batch: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT], {INPUT: batch})[0]


def run_torchscript(path: Path, batch: np.ndarray) -> np.ndarray:
    module = torch.jit.load(str(path), map_location="cpu").eval()
    with torch.no_grad():
        return module(torch.from_numpy(batch)).numpy()


def verify(model: torch.nn.Module, artifacts: dict[str, Path], side: int, batch_size: int = 4,
           seed: int = 0, openvino: tuple[str, Path] | None = None) -> dict[str, float]:
    """Max error relative to the output's scale, per format, on one random batch; eager is the reference.
    `openvino`: (precision, model file) of the engine that will serve, run as it will run (row SERVED_ROW)."""
    batch = np.random.default_rng(seed).standard_normal((batch_size, 3, side, side)).astype(np.float32)
    with torch.no_grad():
        eager = model.eval()(torch.from_numpy(batch)).numpy()
    runners = {"onnx": run_onnx, "torchscript": run_torchscript}
    errors = {"eager": 0.0}
    for name, path in artifacts.items():
        out = runners[name](path, batch)
        if out.shape != eager.shape:
            raise ExportError(f"{name} returned shape {out.shape}, eager {eager.shape}")
        errors[name] = float(np.abs(out - eager).max() / np.abs(eager).max())
    if openvino is not None:
        precision, path = openvino
        out = run_openvino(path, batch, precision)
        errors[f"openvino {precision}"] = float(np.abs(out - eager).max() / np.abs(eager).max())
    return errors


def tolerance(name: str) -> float:
    """What a row may differ from eager by: the exact exports as fp32; the served engine by its precision's
    tolerance (none for int8, which the accuracy gate judges on real images)."""
    if name.startswith("openvino "):
        return TOLERANCES.get(name.split()[1], float("inf"))
    return TOLERANCE


def error_table(errors: dict[str, float]) -> str:
    rows = [f"{'format':<12} {'max rel. error vs eager':>24}  verdict"]
    for name, error in errors.items():
        limit = tolerance(name)
        verdict = ("ok" if error <= limit else f"FAIL (> {limit:g})") if limit < float("inf") else \
            "reported (int8: the accuracy gate above judges it)"
        rows.append(f"{name:<12} {error:>24.3e}  {verdict}")
    return "\n".join(rows)
