"""One image loader (common/decoding.py) for the server, the client and calibration: a phone photo (EXIF-rotated,
16-bit, palette, CMYK) gives the same answer on the tensor path (decoded by the client) and the image path
(decoded by the server)."""
import numpy as np
import pytest
import tritonclient.http as httpclient

from builder import quantize
from clients import classify
from common.decoding import decode
from images import good_images
from support import SMALL, relative_error

KINDS = ["exif-rotated-jpeg", "16bit-png", "palette-gif", "cmyk-jpeg"]


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_path_and_image_path_agree_when_the_photo_needs_more_than_convert_rgb(server, tmp_path, kind):
    data = good_images()[kind]
    path = tmp_path / f"photo.{kind.split('-')[-1]}"
    path.write_bytes(data)
    client = httpclient.InferenceServerClient(server.http_url)
    config, dtype = classify.check_model(client, SMALL)
    tensor_path = classify.infer_logits(httpclient, client, SMALL,
                                        classify.load_images([path], classify.preprocess_for(config), dtype))
    element = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    element.set_data_from_numpy(np.array([[data]], dtype=object))
    image_path = client.infer(f"{SMALL}_image", [element]).as_numpy("LOGITS")
    assert relative_error(tensor_path, image_path) <= 1e-5, kind


@pytest.mark.parametrize("kind", KINDS)
def test_calibration_loads_an_image_as_the_server_decodes_it(tmp_path, kind):
    data = good_images()[kind]
    path = tmp_path / f"photo.{kind.split('-')[-1]}"
    path.write_bytes(data)
    assert np.array_equal(np.asarray(quantize.load_image(path)), np.asarray(decode(data)))
