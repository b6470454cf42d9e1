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
