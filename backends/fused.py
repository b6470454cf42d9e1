"""Triton Python backend: NAME_image as one model — decode, preprocess and classify in one stub.

build-repo copies this file to <repository>/<model>_image/1/model.py with `--image-model fused` (the
default on GPU instances), and beside it the classifier's and the preprocess step's modules, whose code
it runs unchanged: on a GPU instance the batch's JPEGs are decoded in one nvJPEG call on the instance's
GPU (PIL, in a thread pool, for whatever nvJPEG refuses), resized, cropped and normalized there, and the
same runner as NAME classifies them. No GPU tensor crosses processes, and a request carries its JPEG
(~40 KB) instead of 602 KB of floats. A bad image fails its own request alone, as in the ensemble.
"""
from __future__ import annotations

import json

import torch

try:  # in Triton: the helpers sit beside this file in the version folder, which is on sys.path
    from classifier import TritonPythonModel as Classifier
    from contract import IMAGE, IMAGE_BYTES
    from decoding import ImageError
    from preprocess import Preprocessor
    from transforms import transform_from_parameters
    from triton_io import encoded_elements, error_response, model_parameters
except ImportError:
    from backends.classifier import TritonPythonModel as Classifier
    from backends.decoding import ImageError
    from backends.preprocess import Preprocessor
    from backends.triton_io import encoded_elements, error_response, model_parameters
    from common.contract import IMAGE, IMAGE_BYTES
    from common.transforms import transform_from_parameters


class TritonPythonModel(Classifier):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        crop = int(params["crop_size"])
        # The classifier's own initialize, told that its input is the preprocessed IMAGE it runs on.
        as_classifier = {**config, "input": [{"name": IMAGE, "data_type": "TYPE_FP32", "dims": [3, crop, crop]}]}
        super().initialize({**args, "model_config": json.dumps(as_classifier)})
        on_gpu = self.device.type == "cuda"
        workers = int(params.get("decode_workers", "0") or 0) or (4 if on_gpu else 1)
        tensor_decode = on_gpu and params.get("decode_device", "gpu") == "gpu"
        self.preprocess = Preprocessor(transform_from_parameters(params), self.device, tensor_decode, workers)

    def execute(self, requests):
        elements, owners, responses = encoded_elements(requests, IMAGE_BYTES)
        try:
            images = self.preprocess(elements)
        except Exception as exc:  # a device fault: every request of this batch, none silently
            return [r or error_response(f"preprocessing failed: {type(exc).__name__}: {exc}", invalid=False)
                    for r in responses]
        batches, batch_owners = [], []
        for index in range(len(requests)):
            if responses[index] is not None:
                continue
            mine = [image for image, owner in zip(images, owners) if owner == index]
            bad = next(((i, e) for i, e in enumerate(mine) if isinstance(e, ImageError)), None)
            if bad is not None:  # the client's fault: INVALID_ARG (HTTP 400), for this request alone
                responses[index] = error_response(f"{IMAGE_BYTES}[{bad[0]}]: {bad[1]}", invalid=True)
            elif not mine:
                responses[index] = error_response(f"{IMAGE_BYTES} holds no image", invalid=True)
            else:
                batches.append(torch.stack(mine))
                batch_owners.append(index)
        if batches:  # one forward for every good request
            for index, response in zip(batch_owners, self._infer(batches)):
                responses[index] = response
        return responses
