"""The python backend's stub for the Python running the tests serves a model that needs only NumPy.

tests/test_python_floor.py runs this file on Python 3.10 too: there the wheel's 3.10 stub embeds pyenv's
libpython3.10.so, which the loader finds only because serve-repo adds its folder (server.stub_python)."""
import sys

import numpy as np
import tritonclient.http as http

from drills.fuzz import ECHO, WIDTH, write_echo
from server.triton import TritonServer


def test_stub_of_this_python_answers_an_echo_model_when_served(tmp_path):
    # Not conftest's start_server: on 3.10 this file runs without conftest.py, which imports torch.
    repository = tmp_path / "repo"
    write_echo(repository)
    server = TritonServer.local(repository)
    try:
        server.start(timeout=120)
        stubs = server.stubs()
        x = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
        request = http.InferInput("X", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        answer = http.InferenceServerClient(server.http_url).infer(ECHO, [request]).as_numpy("Y")
    finally:
        server.stop()
    assert np.array_equal(answer, x)
    assert stubs, f"no stub of Python {sys.version_info[:2]} ran"
