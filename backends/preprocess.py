"""Triton Python backend: decode image bytes and apply the weights' own transforms() for a classifier.

build-repo copies this file to <repository>/<model>_preprocess/1/model.py; it must stay self-contained.
On a GPU instance JPEGs are decoded there (nvJPEG, batched) and IMAGE is returned in GPU memory.
"""
from __future__ import annotations

import io
import json
import re
import warnings

import numpy as np
import torch
import torchvision
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.dlpack import to_dlpack
from torchvision.io import ImageReadMode, decode_jpeg
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton, e.g. by clients.bench to run the very same engine in-process
    pb_utils = None

INPUT = "IMAGE_BYTES"
OUTPUT = "IMAGE"
DEFAULT_MAX_PIXELS = 50_000_000  # a 48 MP phone photo fits; a decompression bomb does not
EXIF_ORIENTATION = 0x0112


class ImageError(ValueError):
    """This element is not one image we can decode; the message names the problem."""


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.batched = int(config.get("max_batch_size", 0)) > 0
        # PIL checks the size a header claims before decoding a pixel: this bounds each image's memory.
        Image.MAX_IMAGE_PIXELS = int(params.get("max_pixels", DEFAULT_MAX_PIXELS))
        threads = int(params.get("num_threads", "0") or 0)
        device = torch.device("cpu")
        if args.get("model_instance_kind") == "GPU":
            device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
            torch.cuda.set_device(device)
            threads = threads or 4  # PIL fallbacks only; torch's one-per-core default oversubscribes
        if threads > 0:
            torch.set_num_threads(threads)
        # Built once: the preprocessing build-repo recorded (the weights' own transforms() for torchvision).
        transform = transform_from_parameters(params)
        on_device = device.type == "cuda" and params.get("decode_device", "cpu") == "gpu"
        self.preprocess = Preprocessor(transform, device, tensor_decode=on_device)
        self.gpu_output = params.get("output_device", "gpu") == "gpu"

    def execute(self, requests):
        elements, owners, responses = [], [], [None] * len(requests)
        for index, request in enumerate(requests):
            tensor = pb_utils.get_input_tensor_by_name(request, INPUT)
            if tensor is None:
                responses[index] = _error(f"request has no input {INPUT!r}")
                continue
            for element in tensor.as_numpy().reshape(-1):
                elements.append(element if isinstance(element, bytes) else bytes(element))
                owners.append(index)
        try:
            images = self.preprocess(elements)
        except Exception as exc:  # a device fault: every request of this batch, none silently
            return [r or _error(f"preprocessing failed: {type(exc).__name__}: {exc}", invalid=False)
                    for r in responses]
        for index in range(len(requests)):
            if responses[index] is None:
                mine = [image for image, owner in zip(images, owners) if owner == index]
                responses[index] = self._response(mine)
        return responses

    def _response(self, images: list):
        bad = next(((i, e) for i, e in enumerate(images) if isinstance(e, ImageError)), None)
        if bad is not None:  # the client's fault: INVALID_ARG (HTTP 400)
            return _error(f"{INPUT}[{bad[0]}]: {bad[1]}")
        batch = torch.stack(images) if self.batched else images[0]
        if batch.device.type == "cuda" and not self.gpu_output:
            batch = batch.cpu()
        if batch.device.type == "cuda":  # stays on the GPU for the classifier (Triton's CUDA pool)
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack(OUTPUT, to_dlpack(batch))])
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT, batch.numpy())])


def transform_from_parameters(params: dict[str, str]):
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std), as recorded in the
    config (torchvision's ImageClassification, the transforms() of its weights; TorchServe's
    image_classifier is resize 256, crop 224, ImageNet mean/std, bilinear). Repositories built before
    these fields were recorded name torchvision weights in `preprocess_weights` instead."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms._presets import ImageClassification

    if "crop_size" not in params:
        return torchvision.models.get_weight(params["preprocess_weights"]).transforms()
    numbers = lambda key: [float(x) for x in params[key].split(",")]  # noqa: E731
    return ImageClassification(crop_size=int(params["crop_size"]), resize_size=int(params["resize_size"]),
                               mean=numbers("mean"), std=numbers("std"),
                               interpolation=InterpolationMode(params.get("interpolation", "bilinear")))


class Preprocessor:
    """Encoded images -> normalized CHW float tensors on `device`, or the ImageError of each bad one.

    With `tensor_decode`, plain JPEGs (RGB or gray, no EXIF rotation, complete) are decoded together by
    torchvision's decode_jpeg on `device` (nvJPEG on a GPU) and transformed there; everything else, and
    any JPEG that decoder refuses, takes the PIL path, whose errors name the problem.
    """

    def __init__(self, transform, device: torch.device, tensor_decode: bool):
        self.transform, self.device, self.tensor_decode = transform, device, tensor_decode

    def __call__(self, elements: list[bytes]) -> list:
        results = [None] * len(elements)
        fast = []
        for index, data in enumerate(elements):
            try:
                if self.tensor_decode and tensor_decodable(data):
                    fast.append(index)
                else:
                    results[index] = self._pil(data)
            except ImageError as exc:
                results[index] = _detached(exc)
        decoded = self._decode([elements[i] for i in fast])
        for index, image in zip(fast, decoded):
            try:
                results[index] = self._tensor_transform(image) if image is not None else self._pil(elements[index])
            except ImageError as exc:
                results[index] = _detached(exc)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # a CUDA fault raises here, not later
        return results

    def route(self, data: bytes) -> str:
        """"tensor" or "pil": which path `data` takes (for tests and logs)."""
        return "tensor" if self.tensor_decode and tensor_decodable(data) else "pil"

    def _decode(self, blobs: list[bytes]) -> list:
        """uint8 CHW tensors (None where the decoder refused one): one batched call, then one by one."""
        if not blobs:
            return []
        tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
        try:
            return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=self.device))
        except Exception:  # one undecodable file fails the whole batched call
            pass
        images = []
        for tensor in tensors:  # only the culprit falls back to PIL
            try:
                images.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=self.device))
            except Exception:
                images.append(None)
        return images

    def _tensor_transform(self, image: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.transform(image)

    def _pil(self, data: bytes) -> torch.Tensor:
        image = decode(data)
        with torch.inference_mode():
            return self.transform(image).to(self.device, non_blocking=True)


def tensor_decodable(data: bytes) -> bool:
    """True for a complete JPEG whose pixels decode_jpeg gives exactly as PIL would; checks as PIL does."""
    image = open_checked(data)
    if image.format != "JPEG" or image.mode not in ("RGB", "L"):
        return False  # CMYK/YCCK and other formats: PIL converts them
    if image.getexif().get(EXIF_ORIENTATION, 1) != 1:
        return False  # rotated by EXIF: PIL's exif_transpose applies it
    return _jpeg_end(data) is not None  # a truncated file gets PIL's clear error, not a gray tail


def _detached(error: ImageError) -> ImageError:
    """The error without its traceback and context: kept in the results list, they would form a cycle
    (frame -> results -> error -> traceback -> frame) holding the half-decoded image until a full garbage
    collection; measured: +13 MB per 4,000 truncated JPEGs in the stub, none with this."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def _error(message: str, invalid: bool = True):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def open_checked(data: bytes) -> Image.Image:
    """PIL's view of the header (no pixels decoded), or ImageError for empty, unknown, bombs, multi-image."""
    if not data:
        raise ImageError("empty image (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if getattr(image, "n_frames", 1) > 1:
                raise ImageError(f"{image.format} holds {image.n_frames} images; send one image per element")
            if image.format == "JPEG" and _second_jpeg(data):
                raise ImageError("more than one JPEG image in one element; send one image per element")
            return image
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"not an image in a known format ({len(data)} bytes starting {data[:8]!r})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # PIL's text names its own hard limit (twice ours) for the largest bombs: say ours.
        claimed = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(claimed.group(1)):,} pixels" if claimed else "its size"
        raise ImageError(f"decompression bomb refused: the header claims {size}, more than max_pixels "
                         f"{Image.MAX_IMAGE_PIXELS:,}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"truncated or corrupt image: {exc}") from None


def decode(data: bytes) -> Image.Image:
    """One RGB image from encoded bytes, or ImageError saying what is wrong with them."""
    image = open_checked(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"truncated or corrupt {image.format or 'image'}: {exc}") from None
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
    while position + 2 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xD9:  # EOI
            return position + 2
        if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            position += 1 if marker == 0xFF else 2
            continue
        if position + 4 > len(data):
            return None
        length = int.from_bytes(data[position + 2:position + 4], "big")
        position += 2 + length
        if marker == 0xDA:  # start of scan: skip entropy-coded data to the next real marker
            while position + 1 < len(data):
                if data[position] == 0xFF and data[position + 1] not in (0x00, *range(0xD0, 0xD8)):
                    break
                position += 1
    return None
