"""Sample JPEGs for preprocessing checks: the cat photo in the shapes nvJPEG and PIL may treat differently."""
from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

CAT = Path(__file__).resolve().parent.parent / "clients" / "samples" / "chelsea.jpg"


def _jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **options)
    return buffer.getvalue()


def sample_jpegs() -> dict[str, bytes]:
    """The photo as shipped, gray, progressive, large (1600x1064) and odd-sized (301x199), by name.

    perf/results/gpu-preprocess-parity.json and tests/test_preprocess_gpu.py measure these same five."""
    photo = Image.open(CAT).convert("RGB")
    return {"cat": CAT.read_bytes(), "gray": _jpeg(photo.convert("L"), quality=90),
            "progressive": _jpeg(photo, quality=85, progressive=True),
            "large": _jpeg(photo.resize((1600, 1064)), quality=90),
            "odd-size": _jpeg(photo.crop((0, 0, 301, 199)))}
