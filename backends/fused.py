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
    from contract import DECODE_DEVICE, IMAGE
    from preprocess import preprocessed, preprocessor_for
    from transforms import transform_from_parameters
    from triton_io import model_parameters
except ImportError:
    from backends.classifier import TritonPythonModel as Classifier
    from backends.preprocess import preprocessed, preprocessor_for
    from backends.triton_io import model_parameters
    from common.contract import DECODE_DEVICE, IMAGE
    from common.transforms import transform_from_parameters


class TritonPythonModel(Classifier):
    HOST_ROWS = False  # its rows are the torch tensors it decodes into

    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        crop = int(params["crop_size"])
        # The classifier's own initialize, told that its input is the preprocessed IMAGE it runs on.
        as_classifier = {**config, "input": [{"name": IMAGE, "data_type": "TYPE_FP32", "dims": [3, crop, crop]}]}
        super().initialize({**args, "model_config": json.dumps(as_classifier)})
        on_gpu = self.device.type == "cuda"
        workers = int(params.get("decode_workers", "0") or 0) or (4 if on_gpu else 1)
        # gpu: torchvision's decode_jpeg on the instance's device -- nvJPEG on a GPU instance; on a CPU instance
        # (only a config edited by hand: build-repo refuses it for --kind cpu) its CPU decoder, which is how the GPU
        # round's dry run runs this path's code (batched decode, transforms per group of same-size images).
        default = DECODE_DEVICE["fused"] if on_gpu else "cpu"
        tensor_decode = params.get("decode_device", default) == "gpu"
        transform = transform_from_parameters(params)
        self.preprocess = preprocessor_for(params, transform, self.device, tensor_decode, workers)
        self.preprocess.clock = self.clock  # the classifier's measurement mode covers the decoding too

    def execute(self, requests):
        self.clock.start()
        responses, images = preprocessed(self.preprocess, requests)
        good = [index for index, mine in enumerate(images) if mine is not None]
        if good:  # one forward for every good request
            stacked = [torch.stack(images[index]) for index in good]
            self.clock.lap("stack")
            for index, response in zip(good, self._infer(stacked)):
                responses[index] = response
        self.clock.lap("responses")
        self.clock.finish()
        return responses
