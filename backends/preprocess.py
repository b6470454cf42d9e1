"""Triton Python backend: decode image bytes and apply the weights' own transforms() for a classifier.

build-repo copies this file to <repository>/<model>_preprocess/1/model.py; it must stay self-contained.
"""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
import torch
import torchvision
from PIL import Image, ImageOps, UnidentifiedImageError
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton, e.g. by clients.bench to run the very same engine in-process
    pb_utils = None

INPUT = "IMAGE_BYTES"
OUTPUT = "IMAGE"
DEFAULT_MAX_PIXELS = 50_000_000  # a 48 MP phone photo fits; a decompression bomb does not


class ImageError(ValueError):
    """This element is not one image we can decode; the message names the problem."""


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.batched = int(config.get("max_batch_size", 0)) > 0
        # PIL checks the size a header claims before decoding a pixel: this bounds each image's memory.
        Image.MAX_IMAGE_PIXELS = int(params.get("max_pixels", DEFAULT_MAX_PIXELS))
        # Built once: the exact transforms() of the weights the classifier was built for.
        self.transform = torchvision.models.get_weight(params["preprocess_weights"]).transforms()
        threads = int(params.get("num_threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            tensor = pb_utils.get_input_tensor_by_name(request, INPUT)
            if tensor is None:
                raise ImageError(f"request has no input {INPUT!r}")
            elements = tensor.as_numpy().reshape(-1)
            images = [self._image(element, index) for index, element in enumerate(elements)]
            batch = np.stack(images) if self.batched else images[0]
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT, batch)])
        except ImageError as exc:  # the client's fault: INVALID_ARG (HTTP 400) where this Triton has codes
            code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
            error = pb_utils.TritonError(str(exc), code) if code is not None else pb_utils.TritonError(str(exc))
            return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def _image(self, element, index: int) -> np.ndarray:
        data = element if isinstance(element, bytes) else bytes(element)
        try:
            image = decode(data)
        except ImageError as exc:
            raise ImageError(f"{INPUT}[{index}]: {exc}") from None
        with torch.inference_mode():
            return self.transform(image).numpy()


def decode(data: bytes) -> Image.Image:
    """One RGB image from encoded bytes, or ImageError saying what is wrong with them."""
    if not data:
        raise ImageError("empty image (0 bytes)")
    image = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if getattr(image, "n_frames", 1) > 1:
                raise ImageError(f"{image.format} holds {image.n_frames} images; send one image per element")
            if image.format == "JPEG" and _second_jpeg(data):
                raise ImageError("more than one JPEG image in one element; send one image per element")
            image.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"not an image in a known format ({len(data)} bytes starting {data[:8]!r})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"decompression bomb refused: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"truncated or corrupt {getattr(image, 'format', None) or 'image'}: {exc}") from None
    return to_rgb(ImageOps.exif_transpose(image))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB for any mode: 16-bit and float grayscale are scaled, not clipped to white."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or pixels.max() > 255 else 255.0
        image = Image.fromarray(np.clip(pixels / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif image.mode == "F":
        pixels = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(pixels * (255.0 if pixels.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8))
    return image.convert("RGB")


def _second_jpeg(data: bytes) -> bool:
    """True if another JPEG starts after the end (EOI) of the first one's entropy-coded scans."""
    end = _jpeg_end(data)
    return end is not None and data.find(b"\xff\xd8\xff", end) != -1


def _jpeg_end(data: bytes) -> int | None:
    position = 2  # after SOI
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xD9:  # EOI
            return position + 2
        if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            position += 1 if marker == 0xFF else 2
            continue
        length = int.from_bytes(data[position + 2:position + 4], "big")
        position += 2 + length
        if marker == 0xDA:  # start of scan: skip entropy-coded data to the next real marker
            while position + 1 < len(data):
                if data[position] == 0xFF and data[position + 1] not in (0x00, *range(0xD0, 0xD8)):
                    break
                position += 1
    return None
