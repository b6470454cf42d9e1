"""The main job on the real ResNet-152: build, serve, classify a cat photo with the client script."""
import re
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

from clients import classify
import tritonclient.http as httpclient

from support import LARGE, reference_model, relative_error

CAT = Path(__file__).resolve().parent.parent / "clients" / "samples" / "chelsea.jpg"


def test_classify_prints_in_process_top5_when_resnet152_is_served(server, capsys):
    assert classify.main([str(CAT), "--url", server.http_url, "--model", LARGE, "--top-k", "5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"{CAT}:"
    rows = [re.fullmatch(r'\s+"(.+)": ([0-9.]+)', line).groups() for line in printed[1:]]
    assert len(rows) == 5

    # Served logits of the same preprocessed photo equal in-process ResNet-152's.
    weights = torchvision.models.ResNet152_Weights.DEFAULT
    image = weights.transforms()(Image.open(CAT).convert("RGB")).unsqueeze(0)
    with torch.inference_mode():
        expected = reference_model(LARGE)(image)
    served = classify.infer_logits(httpclient, httpclient.InferenceServerClient(server.http_url), LARGE,
                                   image.numpy())
    assert relative_error(served, expected.numpy()) <= 1e-4
    # Random ResNet-152 logits are ~1e7 wide, so softmax puts ~1.0 on one class and exact zeros on the
    # rest: compare the top class and the printed probabilities, and the top-5 by logits above.
    assert list(np.argsort(-served[0])[:5]) == expected[0].topk(5).indices.tolist()
    probs = expected.softmax(dim=1)[0]
    assert rows[0][0] == weights.meta["categories"][int(probs.argmax())]
    np.testing.assert_allclose([float(p) for _, p in rows], probs.topk(5).values.numpy(), atol=1e-6)


def test_classify_exits_1_with_one_line_when_model_is_missing(server, capsys):
    assert classify.main([str(CAT), "--url", server.http_url, "--model", "no_such_model"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no_such_model" in err and len(err.splitlines()) == 1
