"""The JPEG end scan (common/decoding.py's _jpeg_end), before and after: a Python step per byte vs one re search.

Every element is scanned to find where its JPEG ends (two JPEGs in one element are refused, a truncated one
goes to PIL); the tensor path used to scan twice. Timed on the 38 KB sample and a ~5 MB JPEG (the sample
resized to 3000x2000 with noise, quality 95), both scans checked to give the same end.

    python -m perf.jpeg_scan --out perf/results/jpeg-scan.json
"""
from __future__ import annotations

import io
import platform
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from common.cli import OneLineParser, write_result


def before_per_byte_end(data: bytes) -> int | None:
    """BEFORE (the code this replaced, kept to time it): the entropy-coded data walked one byte per Python step."""
    position = 2
    while position + 2 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xD9:
            return position + 2
        if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            position += 1 if marker == 0xFF else 2
            continue
        if position + 4 > len(data):
            return None
        length = int.from_bytes(data[position + 2:position + 4], "big")
        position += 2 + length
        if marker == 0xDA:
            while position + 1 < len(data):
                if data[position] == 0xFF and data[position + 1] not in (0x00, *range(0xD0, 0xD8)):
                    break
                position += 1
    return None


def large_jpeg(width: int, height: int, noise: int) -> bytes:
    """The sample cat resized to width x height plus uniform noise of +-noise levels (seed 0), quality 95."""
    from perf.samples import CAT

    base = np.asarray(Image.open(CAT).convert("RGB").resize((width, height)), dtype=np.int16)
    noisy = base + np.random.default_rng(0).integers(-noise, noise + 1, base.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def best_ms(scan, data: bytes, seconds: float) -> tuple[float, int]:
    """The fastest of repeated scans of `data` (at least 3, for about `seconds`), ms, and how many ran."""
    times, started = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < seconds:
        start = time.perf_counter()
        scan(data)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, len(times)


def measure(name: str, data: bytes, seconds: float) -> dict:
    from common.decoding import _jpeg_end

    if _jpeg_end(data) != before_per_byte_end(data) or _jpeg_end(data) is None:
        raise RuntimeError(f"{name}: the two scans disagree")
    before, before_runs = best_ms(before_per_byte_end, data, seconds)
    after, after_runs = best_ms(_jpeg_end, data, seconds)
    megabytes = len(data) / 1e6
    return {"image": name, "bytes": len(data), "before_ms": round(before, 3), "after_ms": round(after, 4),
            "before_ms_per_mb": round(before / megabytes, 2), "after_ms_per_mb": round(after / megabytes, 4),
            "speedup": round(before / after, 1), "runs_before": before_runs, "runs_after": after_runs}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m perf.jpeg_scan", description=__doc__)
    p.add_argument("--size", default="3000x2000", help="the large JPEG's WIDTHxHEIGHT. Default: 3000x2000.")
    p.add_argument("--noise", type=int, default=48, help="its noise, +- levels (more: larger file). Default: 48.")
    p.add_argument("--seconds", type=float, default=2.0, help="time spent per scan and image. Default: 2.0.")
    p.add_argument("--out", type=Path, help="JSON to write. Default: none (print only).")
    args = p.parse_args(argv)
    try:
        width, height = (int(side) for side in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--size must be WIDTHxHEIGHT, got {args.size!r}")

    from common.cpu import cpuinfo
    from perf.samples import CAT

    images = {CAT.name: CAT.read_bytes(), f"noisy-{width}x{height}-q95": large_jpeg(width, height, args.noise)}
    rows = [measure(name, data, args.seconds) for name, data in images.items()]
    result = {"command": " ".join(["python -m perf.jpeg_scan", *(argv if argv is not None else sys.argv[1:])]),
              "cpu": cpuinfo("model name"), "python": platform.python_version(),
              "before": "per-byte Python loop over the entropy-coded data (before_per_byte_end)",
              "after": "common.decoding._jpeg_end: one compiled re search per scan",
              "large_jpeg": f"the sample resized to {width}x{height}, +-{args.noise} levels of noise, quality 95",
              "scans_per_image_tensor_path": {"before": 2, "after": 1}, "images": rows}
    text = write_result(result, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
