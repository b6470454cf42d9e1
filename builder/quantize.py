"""Post-training int8 quantization of the ONNX export, calibrated on the user's own images (build-repo --calibration)."""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from builder.options import Preprocessing
from common.contract import IMAGE as INPUT
from common.cpu import cpu_int8_dot
from common.transforms import transform_from_parameters

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# MinMax calibration settles within a few dozen images; more only lengthen the build (each batch is one
# fp32 forward of the model with every activation kept as an extra output).
MAX_IMAGES = 64
BATCH_SIZE = 8


class QuantizeError(RuntimeError):
    """Calibration images missing or unreadable, or quantization failed; one line, for BuildError to carry."""


def calibration_files(folder: Path, limit: int = MAX_IMAGES) -> list[Path]:
    """The first `limit` images of `folder` by name (sorted, so the same folder calibrates the same way)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QuantizeError(f"calibration folder {folder} does not exist or is not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise QuantizeError(f"calibration folder {folder} holds no {'/'.join(IMAGE_SUFFIXES)} images")
    return files[:limit]


def load_image(path: Path):
    """One RGB PIL image decoded exactly as the server decodes it (common/decoding.py: EXIF orientation,
    16-bit and palette images, the pixel bound), or QuantizeError naming the file."""
    from common.decoding import ImageError, decode

    try:
        return decode(path.read_bytes())
    except (OSError, ImageError) as exc:
        raise QuantizeError(f"calibration image {path} is unreadable: {exc}") from None


def preprocess(images: Iterable, preprocessing: Preprocessing) -> np.ndarray:
    """PIL images -> one float32 NCHW array, through the preprocessing the served model records."""
    transform = transform_from_parameters(preprocessing.parameters())
    return np.stack([transform(image).numpy() for image in images]).astype(np.float32)


def calibration_batches(folder: Path, preprocessing: Preprocessing, batch_size: int = BATCH_SIZE,
                        limit: int = MAX_IMAGES) -> list[np.ndarray]:
    """Every image of `folder` (up to `limit`), preprocessed, in batches of `batch_size` (the last may be short)."""
    return batched([load_image(path) for path in calibration_files(folder, limit)], preprocessing, batch_size)


def batched(images: list, preprocessing: Preprocessing, batch_size: int = BATCH_SIZE) -> list[np.ndarray]:
    """PIL images, preprocessed, in batches of `batch_size` (the last may be short)."""
    return [preprocess(images[i:i + batch_size], preprocessing) for i in range(0, len(images), batch_size)]


def _reader(batches: list[np.ndarray]):
    """onnxruntime's CalibrationDataReader over arrays already in memory (get_next until None, rewind)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.position = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.position >= len(batches):
                return None
            self.position += 1
            return {INPUT: batches[self.position - 1]}

        def rewind(self) -> None:
            self.position = 0

    return Batches()


def quantize_int8(onnx_path: Path, out_path: Path, batches: Iterable[np.ndarray], *,
                  activations: str = "uint8", per_channel: bool = True) -> Path:
    """`onnx_path` (fp32) -> `out_path`: QDQ int8, weights int8 per output channel, activations `activations`
    with ranges from MinMax calibration over `batches` (NCHW float32, preprocessed like served images).

    uint8 activations by default: x86's int8 dot products (VNNI's vpdpbusd) multiply unsigned by signed
    bytes, so int8 activations need a shift where VNNI is absent. With VNNI (AMD EPYC, AVX-512) int8
    activations ran ResNet-152 as fast under OpenVINO (29.9 / 30.1 img/s at batch 1 / 8 vs 28.8 / 31.6,
    medians of 6 alternated runs) and as close to fp32 (EfficientNet-Lite0: worst probability difference
    0.116 vs 0.120), so either is sound there. Without VNNI (an AVX2-only AMD EPYC, 2026-11-28) vpmaddubsw's 16-bit
    pairwise sums saturate: EfficientNet-Lite0 moved a probability by 0.45 and the gate refused the build; weights
    are then quantized to 7 bits (onnxruntime's reduce_range, which keeps those sums in range), and it passes.

    QDQ keeps the graph an ordinary ONNX model with QuantizeLinear/DequantizeLinear pairs; OpenVINO folds
    them into int8 kernels (VNNI/AMX), onnxruntime runs them too. MinMax over the same batches gives the
    same scales, so the same inputs quantize to the same file.
    """
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    batches = [np.ascontiguousarray(b, dtype=np.float32) for b in batches]
    if not batches:
        raise QuantizeError("no calibration images: int8 needs at least one batch to set activation ranges")
    if activations not in ("uint8", "int8"):
        raise QuantizeError(f"activations must be uint8 or int8, not {activations!r}")
    reader = _reader(batches)
    activation_type = QuantType.QUInt8 if activations == "uint8" else QuantType.QInt8
    # onnxruntime logs a warning per unused initializer of every calibration session (hundreds of lines),
    # and advises "pre-processing" on the root logger: neither is the user's to act on.
    onnxruntime.set_default_logger_severity(3)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # onnxruntime writes its augmented (every activation an output) copy in its own temp folder.
            quantize_static(str(onnx_path), str(out_path), reader, quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, weight_type=QuantType.QInt8, activation_type=activation_type,
                            calibrate_method=CalibrationMethod.MinMax, calibration_providers=["CPUExecutionProvider"],
                            reduce_range=not cpu_int8_dot())
    except Exception as exc:  # onnxruntime raises bare Exceptions, ValueErrors and ORT errors alike
        raise QuantizeError(f"int8 quantization of {onnx_path.name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        onnxruntime.set_default_logger_severity(2)  # onnxruntime's default, warnings
        root.setLevel(level)
    return Path(out_path)
