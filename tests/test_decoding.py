"""common/decoding.py's JPEG end scan (one C-level search, once per image) and the bounds every model applies."""
import random

import pytest
from PIL import Image

from common import decoding
from common.decoding import ImageError, _jpeg_end, open_checked, tensor_decodable, tensor_pixels
from images import CAT, cat, encode
# The per-byte scan _jpeg_end replaced, kept verbatim where it is timed: the new one must give its answers.
from perf.jpeg_scan import before_per_byte_end as _reference_end


def _jpegs() -> dict[str, bytes]:
    photo = cat()
    shipped = CAT.read_bytes()
    return {"sample": shipped,
            "progressive": encode(photo, "JPEG", quality=85, progressive=True),
            "restart-markers": encode(photo, "JPEG", quality=90, restart_marker_blocks=1),
            "progressive-restart": encode(photo, "JPEG", progressive=True, restart_marker_blocks=4),
            "grayscale": encode(photo.convert("L"), "JPEG", quality=90),
            "fill-bytes": shipped[:2] + b"\xff\xff\xff" + shipped[2:],
            "tem-marker": shipped[:2] + b"\xff\x01" + shipped[2:],
            "two-concatenated": shipped + encode(photo, "JPEG")}


@pytest.mark.parametrize("name", list(_jpegs()))
def test_jpeg_end_matches_per_byte_reference_when_jpeg_is_complete(name):
    data = _jpegs()[name]
    end = _jpeg_end(data)
    assert end is not None and end == _reference_end(data)
    assert data[end - 2:end] == b"\xff\xd9"


def test_jpeg_end_stops_at_the_first_image_when_two_jpegs_are_concatenated():
    first = CAT.read_bytes()
    assert _jpeg_end(first + encode(cat(), "JPEG")) == len(first)


@pytest.mark.parametrize("name", list(_jpegs()))
def test_jpeg_end_is_none_like_the_reference_when_jpeg_is_truncated(name):
    data = _jpegs()[name]
    first = _reference_end(data)
    for cut in (3, 20, first // 3, first // 2, first - 3, first - 1):
        assert _jpeg_end(data[:cut]) is None and _reference_end(data[:cut]) is None


def test_jpeg_end_matches_per_byte_reference_when_bytes_are_corrupted():
    # Flipped bytes and 0xFF pairs anywhere (headers, stuffing, markers): both scans agree, end or None.
    rng = random.Random(0)
    jpegs = list(_jpegs().values())
    for _ in range(300):
        data = bytearray(rng.choice(jpegs))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(2, len(data) - 1)
            data[at:at + 2] = bytes([0xFF, rng.choice([0x00, 0xD3, 0xD9, 0xDA, 0xFF, 0x01, rng.randrange(256)])])
        data = bytes(data[:rng.randrange(4, len(data) + 1)])
        assert _jpeg_end(data) == _reference_end(data)


def test_tensor_decodable_scans_a_jpeg_once_when_checking_it(monkeypatch):
    calls = []
    original = decoding._jpeg_end
    monkeypatch.setattr(decoding, "_jpeg_end", lambda data: calls.append(len(data)) or original(data))
    assert tensor_decodable(CAT.read_bytes())
    assert calls == [len(CAT.read_bytes())]


def test_tensor_pixels_gives_the_header_size_when_jpeg_is_plain():
    assert tensor_pixels(CAT.read_bytes()) == 451 * 300
    assert tensor_pixels(CAT.read_bytes()[:10_000]) == 0  # truncated: PIL's path


def test_open_checked_refuses_two_jpegs_when_concatenated_in_one_element():
    with pytest.raises(ImageError, match="more than one JPEG"):
        open_checked(CAT.read_bytes() + encode(cat(), "JPEG"))


@pytest.mark.parametrize("params, bound", [({}, decoding.DEFAULT_MAX_PIXELS), ({"max_pixels": "1234"}, 1234),
                                           ({"max_pixels": ""}, decoding.DEFAULT_MAX_PIXELS)])
def test_apply_max_pixels_sets_pil_bound_when_given_parameters(monkeypatch, params, bound):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    assert decoding.apply_max_pixels(params) == bound and Image.MAX_IMAGE_PIXELS == bound


# The decode's own peak: the kernel's high-water mark of this process's RSS, reset just before it (clear_refs 5).
_PEAK = """
import sys
from common.decoding import decode
def kb(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
data = sys.stdin.buffer.read()
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
before = kb("VmRSS")
image = decode(data)
print(image.mode, image.size[0] * image.size[1], (kb("VmHWM") - before) // 1024, kb("VmHWM") // 1024)
"""


def test_decode_of_a_16_bit_photo_of_49m_pixels_stays_under_600_mb_when_it_is_a_tiny_png():
    """Issue 42 A2: a 95 KB 16-bit grayscale PNG of 49 M pixels (under max_pixels) cost the preprocess stub 1.3 GB
    through a float64 copy. Peak memory of the decode, measured in a process of its own (kernel's max RSS)."""
    import io
    import subprocess
    import sys

    side = 7000  # 49 M pixels, under DEFAULT_MAX_PIXELS (50 M)
    buffer = io.BytesIO()
    Image.new("I;16", (side, side), 40000).save(buffer, "PNG")
    assert len(buffer.getvalue()) < 200_000
    done = subprocess.run([sys.executable, "-c", _PEAK], input=buffer.getvalue(), capture_output=True, timeout=300,
                          cwd=decoding.__file__.rsplit("/common/", 1)[0])
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    mode, pixels, grown_mb, peak_mb = done.stdout.decode().split()
    assert (mode, int(pixels)) == ("RGB", side * side)
    assert int(grown_mb) <= 600, f"decode grew the process by {grown_mb} MB (peak {peak_mb} MB)"


@pytest.mark.parametrize("mode, values, expected", [
    ("I;16", [0, 128, 257, 32767, 32768, 65535], [0, 0, 1, 127, 128, 255]),
    ("I", [0, 1, 128, 255], [0, 1, 128, 255]),                     # 8-bit values in a 32-bit image: kept
    ("I", [-5, 0, 32768, 65535, 70000], [0, 0, 128, 255, 255]),   # beyond 255: scaled as 16-bit, clipped
    ("F", [-1.0, 0.0, 0.5, 1.0], [0, 0, 127, 255]),                # 0..1 floats scaled
    ("F", [0.0, 100.0, 300.0], [0, 100, 255]),                     # beyond 1: taken as levels, clipped
])
def test_to_rgb_scales_16_bit_int_and_float_gray_to_8_bit_levels_when_given_each_mode(mode, values, expected):
    import numpy as np

    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    image = Image.fromarray(np.array([values], dtype=dtype))
    assert image.mode == mode
    rgb = decoding.to_rgb(image)
    assert rgb.mode == "RGB" and list(np.asarray(rgb)[0, :, 0]) == expected
