"""Encoded bytes -> one checked RGB image, or an ImageError that names what is wrong with them.

build-repo copies this file beside NAME_preprocess's model.py; it must stay self-contained.
"""
from __future__ import annotations

import io
import re
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 50_000_000  # a 48 MP phone photo fits; a decompression bomb does not
EXIF_ORIENTATION = 0x0112
# In entropy-coded data a 0xFF is either stuffed (0xFF00) or a restart marker (0xFFD0-D7); any other byte
# after it starts the next marker. One C-level search instead of a Python step per byte (holding the GIL):
# 69-74 -> 0.35-0.50 ms per MB, 2.7 -> 0.02 ms for the 38 KB sample (perf/results/jpeg-scan.json).
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")


class ImageError(ValueError):
    """This element is not one image we can decode; the message names the problem."""


def apply_max_pixels(params: dict[str, str]) -> int:
    """Sets PIL's process-wide bound from the `max_pixels` parameter (DEFAULT_MAX_PIXELS if absent); returns it.

    PIL checks the size a header claims before decoding a pixel: this bounds each image's memory."""
    Image.MAX_IMAGE_PIXELS = int(params.get("max_pixels", "") or DEFAULT_MAX_PIXELS)
    return Image.MAX_IMAGE_PIXELS


def tensor_decodable(data: bytes) -> bool:
    """True for a complete JPEG whose pixels decode_jpeg gives exactly as PIL would; checks as PIL does."""
    return tensor_pixels(data) > 0


def tensor_pixels(data: bytes) -> int:
    """The pixel count its header declares if tensor_decodable(data), else 0 (raises ImageError as PIL would)."""
    image, end = _opened(data)
    if image.format != "JPEG" or image.mode not in ("RGB", "L"):
        return 0  # CMYK/YCCK and other formats: PIL converts them
    if image.getexif().get(EXIF_ORIENTATION, 1) != 1:
        return 0  # rotated by EXIF: PIL's exif_transpose applies it
    if end is None:
        return 0  # a truncated file gets PIL's clear error, not a gray tail
    return image.width * image.height


def detached(error: ImageError) -> ImageError:
    """The error without its traceback and context: kept in the results list, they would form a cycle
    (frame -> results -> error -> traceback -> frame) holding the half-decoded image until a full garbage
    collection; measured: +13 MB per 4,000 truncated JPEGs in the stub, none with this."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def open_checked(data: bytes) -> Image.Image:
    """PIL's view of the header (no pixels decoded), or ImageError for empty, unknown, bombs, multi-image."""
    return _opened(data)[0]


def _opened(data: bytes) -> tuple[Image.Image, int | None]:
    """open_checked's image and, for a JPEG, where its EOI ends (None if truncated): scanned once per image."""
    if not data:
        raise ImageError("empty image (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if getattr(image, "n_frames", 1) > 1:
                raise ImageError(f"{image.format} holds {image.n_frames} images; send one image per element")
            end = _jpeg_end(data) if image.format == "JPEG" else None
            if end is not None and data.find(b"\xff\xd8\xff", end) != -1:  # another JPEG after the first's EOI
                raise ImageError("more than one JPEG image in one element; send one image per element")
            return image, end
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


_BAND_PIXELS = 1 << 20  # to_rgb converts wide images a band of rows at a time: its temporaries stay a few MB


def _bands(image: Image.Image):
    """The image's pixels as arrays of whole rows, about _BAND_PIXELS each, and where each band starts."""
    width, height = image.size
    rows = max(1, _BAND_PIXELS // max(1, width))
    for top in range(0, height, rows):
        yield top, np.asarray(image.crop((0, top, width, min(height, top + rows))))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB for any mode: 16-bit and float grayscale are scaled, not clipped to white. Scaled a band of rows at a
    time into one 8-bit plane, never through a whole float64 copy (a 16-bit 49 M-pixel PNG cost 1.3 GB that way)."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        levels = np.empty((image.size[1], image.size[0]), dtype=np.uint8)
        if image.mode.startswith("I;16"):
            top = 65535
        else:  # 32-bit int or float: its largest value says which range it holds
            top = max((float(band.max()) for _, band in _bands(image)), default=0.0)
        for start, band in _bands(image):
            if image.mode == "F":  # 0..1 floats are scaled; larger ones are taken as levels
                scaled = band * np.float32(255.0 if top <= 1.0 else 1.0)
            else:  # round(v / top * 255), in integers: 16-bit, or 8-bit values in a 32-bit image
                full = 65535 if image.mode.startswith("I;16") or top > 255 else 255
                scaled = (band.astype(np.int64) * 255 + full // 2) // full
            levels[start:start + band.shape[0]] = np.clip(scaled, 0, 255)
        image = Image.fromarray(levels)
    return image.convert("RGB")


def _jpeg_end(data: bytes) -> int | None:
    """Index just past the first JPEG's EOI marker, walking its segments; None if the data ends first."""
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
            found = _NEXT_MARKER.search(data, position)
            if found is None:
                return None
            position = found.start()
    return None
