"""Real image files for the tests: the scikit-image cat in many encodings, and broken ones."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from support import ROOT

CAT = ROOT / "clients" / "samples" / "chelsea.jpg"


def cat() -> Image.Image:
    return Image.open(CAT).convert("RGB")


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def good_images() -> dict[str, bytes]:
    """Encodings a user may send; each must be served."""
    photo = cat()
    rgba = photo.convert("RGBA")
    rgba.putalpha(200)
    rotated = encode(photo.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95,
                     exif=_exif_orientation(8))  # stored sideways, EXIF says "rotate back"
    sixteen = Image.fromarray(np.asarray(photo.convert("L"), dtype=np.uint16) * 257)  # mode I;16
    return {
        "jpeg": CAT.read_bytes(),
        "grayscale-png": encode(photo.convert("L"), "PNG"),
        "rgba-png": encode(rgba, "PNG"),
        "palette-gif": encode(photo.convert("P", palette=Image.Palette.ADAPTIVE), "GIF"),
        "cmyk-jpeg": encode(photo.convert("CMYK"), "JPEG", quality=95),
        "16bit-png": encode(sixteen, "PNG"),
        "tiny-1x1-png": encode(Image.new("RGB", (1, 1), (200, 30, 30)), "PNG"),
        "exif-rotated-jpeg": rotated,
        "webp": encode(photo, "WEBP", quality=90),
    }


def bad_images() -> dict[str, tuple[bytes, str]]:
    """Bytes that are not one servable image, with the phrase the error must contain."""
    jpeg = CAT.read_bytes()
    frames = [cat(), cat().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    return {
        "empty": (b"", "empty image"),
        "text": (b"this is a text file, not an image\n" * 20, "not an image in a known format"),
        "truncated-jpeg": (jpeg[: len(jpeg) // 3], "truncated or corrupt"),
        "random-bytes": (np.random.default_rng(1).bytes(20_000), "not an image in a known format"),
        "decompression-bomb": (_png_claiming(50_000, 50_000), "decompression bomb refused"),
        "two-jpegs-in-one": (jpeg + jpeg, "more than one JPEG"),
        "animated-gif": (gif.getvalue(), "holds 2 images"),
    }


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels (a decompression bomb's calling card)."""
    data = bytearray(encode(Image.new("L", (1, 1)), "PNG"))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr:ihdr + 17]))
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def _exif_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()
