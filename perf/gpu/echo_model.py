"""A python-backend model that answers each request with its input's first values (no compute at all).

perf.gpu.served copies this file as model.py; it runs only inside Triton's stub, where
triton_python_backend_utils exists. Two uses: the python backend's own ceiling (what a served model
cannot beat whatever it computes), and a GPU output tensor in isolation: with the config parameter
output_device = "gpu" it answers with a torch CUDA tensor handed over by DLPack, as NAME_preprocess
does on a GPU instance, but without decoding or transforms that could fail on their own.
"""
import faulthandler
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if os.environ.get("PYTHONFAULTHANDLER"):  # the stub's Python is isolated: it ignores the variable
            faulthandler.enable()
        config = json.loads(args["model_config"])
        self.input, self.output = config["input"][0]["name"], config["output"][0]["name"]
        self.width = int(config["output"][0]["dims"][0])
        parameter = config.get("parameters", {}).get("output_device", {})
        self.gpu_output = parameter.get("string_value", "cpu") == "gpu"
        if self.gpu_output:
            import torch  # only here: the CPU echo measures the backend, not torch's import
            from torch.utils.dlpack import to_dlpack

            self.torch, self.to_dlpack = torch, to_dlpack
            self.device = torch.device("cuda", int(args["model_instance_device_id"]))
            torch.cuda.set_device(self.device)  # DLPack refuses a tensor on a device other than the current one

    def execute(self, requests):
        responses = []
        for request in requests:  # one response per request: the per-request cost is what is measured
            images = pb_utils.get_input_tensor_by_name(request, self.input).as_numpy()
            rows = np.ascontiguousarray(images.reshape(images.shape[0], -1)[:, : self.width])
            if self.gpu_output:
                on_gpu = self.torch.from_numpy(rows).to(self.device)
                tensor = pb_utils.Tensor.from_dlpack(self.output, self.to_dlpack(on_gpu))
            else:
                tensor = pb_utils.Tensor(self.output, rows)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses
