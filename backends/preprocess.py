"""Triton Python backend: decode image bytes and apply the weights' own transforms() for a classifier.

build-repo copies this file to <repository>/<model>_preprocess/1/model.py and its helpers beside it
(decoding, triton_io, and common/contract.py, common/transforms.py).
On a GPU instance JPEGs are decoded there (nvJPEG, batched) and IMAGE is returned in GPU memory. On a CPU instance
(the host path) PIL decodes and NumPy carries the pixels: the stub imports no torch (~2 s of CPU less per start).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton, e.g. by tests and perf to run the same preprocessing
    pb_utils = None
try:  # in Triton: the helpers sit beside this file in the version folder, which is on sys.path
    from contract import DECODE_DEVICE, IMAGE_BYTES
    from decoding import ImageError, apply_max_pixels, decode, detached, tensor_decodable, tensor_pixels
    from stage_clock import StageClock
    from transforms import pixels_from_parameters, transform_from_parameters
    from triton_io import (Host, LazyTorch, device_fault, encoded_elements, error_response, exit_soon, first_line,
                           honor_faulthandler, instance_device, model_parameters, on_host)
except ImportError:
    from backends.stage_clock import StageClock
    from common.decoding import ImageError, apply_max_pixels, decode, detached, tensor_decodable, tensor_pixels
    from backends.triton_io import (Host, LazyTorch, device_fault, encoded_elements, error_response, exit_soon,
                                    first_line, honor_faulthandler, instance_device, model_parameters, on_host)
    from common.contract import DECODE_DEVICE, IMAGE_BYTES
    from common.transforms import pixels_from_parameters, transform_from_parameters

torch = LazyTorch()  # imported where a path needs it: the host path never does
# Triton's output types -> NumPy's and torch's dtype names
OUTPUT_DTYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_UINT8": "uint8"}
# nvJPEG holds a whole batch's pixels at once (64 x 50 MP x 3 B = 9.6 GB): decode in chunks under this.
DEFAULT_GPU_DECODE_BUDGET_MB = 1024


class TritonPythonModel:
    def initialize(self, args):
        honor_faulthandler()
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        self.batched = int(config.get("max_batch_size", 0)) > 0
        threads = int(params.get("num_threads", "0") or 0)
        # The host path: a CPU instance whose config records its transform (every build since crop_size was).
        self.host = on_host(args) and "crop_size" in params
        device = Host() if self.host else instance_device(args)
        if device.type == "cuda":
            threads = threads or 4  # PIL fallbacks only; torch's one-per-core default oversubscribes
        else:
            # PIL decodes and resizes on one thread anyway; torch's pool (one thread per core) only spins
            # on the cores the classifier's engine is using. ResNet-18 image path on 2 cores, OpenVINO:
            # c=1 40 -> 47 img/s, c=8 50 -> 62 (perf/results/README.md, CPU engines).
            threads = threads or 1
        if not self.host:
            torch.set_num_threads(threads)
        # What the classifier takes (build-repo's --input-dtype): IMAGE normalized, IMAGE_FP16 the same in half
        # the bytes, or IMAGE_UINT8, the pixels before normalizing (the classifier normalizes them).
        output = config["output"][0]
        self.output_name = output["name"]
        self.output_dtype = OUTPUT_DTYPES[output["data_type"]]
        # Built once: the preprocessing build-repo recorded (the weights' own transforms() for torchvision).
        made = pixels_from_parameters if self.output_dtype == "uint8" else transform_from_parameters
        transform = made(params, tensors=not self.host)
        on_device = device.type == "cuda" and params.get("decode_device", DECODE_DEVICE["ensemble"]) == "gpu"
        self.preprocess = preprocessor_for(params, transform, device, tensor_decode=on_device, host=self.host)
        self.gpu_output = params.get("output_device", "gpu") == "gpu"

    def execute(self, requests):
        responses, images = preprocessed(self.preprocess, requests)
        for index, mine in enumerate(images):
            if mine is not None:
                responses[index] = self._response(mine)
        return responses

    def _response(self, images: list):
        if self.host:  # NumPy rows: the same casts as torch's below, the same bits
            batch = np.stack(images) if self.batched else images[0]
            batch = np.ascontiguousarray(batch, dtype=self.output_dtype)
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, batch)])
        batch = torch.stack(images) if self.batched else images[0]
        if batch.dtype != getattr(torch, self.output_dtype):  # fp16: normalized floats, halved for the hop
            batch = batch.to(getattr(torch, self.output_dtype))
        if batch.device.type == "cuda" and not self.gpu_output:
            batch = batch.cpu()
        if batch.device.type == "cuda":  # stays on the GPU for the classifier (Triton's CUDA pool)
            # python_backend copies it on a stream of its own: the stack and cast queued on ours must be done.
            torch.cuda.current_stream(batch.device).synchronize()
            from torch.utils.dlpack import to_dlpack

            return pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor.from_dlpack(self.output_name, to_dlpack(batch))])
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, batch.numpy())])


def preprocessor_for(params: dict[str, str], transform, device: torch.device, tensor_decode: bool,
                     workers: int = 1, host: bool = False) -> "Preprocessor":
    """The Preprocessor a model's config parameters ask for (NAME_preprocess and the fused model alike); also
    sets PIL's process-wide pixel bound from `max_pixels`, so every model that decodes refuses the same bombs."""
    apply_max_pixels(params)
    budget_mb = float(params.get("gpu_decode_budget_mb", "") or DEFAULT_GPU_DECODE_BUDGET_MB)
    return Preprocessor(transform, device, tensor_decode, workers, decode_budget=int(budget_mb * 2**20), host=host)


def decode_chunks(pixels: list[int], budget: int) -> list[list[int]]:
    """Indices of `pixels` in order, grouped so that each group's pixels x 3 bytes stay within `budget`
    (an image over the budget on its own goes alone)."""
    chunks, used = [], 0
    for index, count in enumerate(pixels):
        if not chunks or used + count * 3 > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(index)
        used += count * 3
    return chunks


def preprocessed(preprocess: "Preprocessor", requests) -> tuple[list, list]:
    """One decode for the whole batch, then per request: its error response (no input, a bad image: the
    client's fault, INVALID_ARG; a device fault: the server's, for every request) or its list of images."""
    elements, owners, responses = encoded_elements(requests, IMAGE_BYTES)
    try:
        images = preprocess(elements)
    except Exception as exc:  # a device fault: every request of this batch, none silently
        message = f"preprocessing failed: {type(exc).__name__}: {first_line(exc)}"
        if device_fault(exc):
            exit_soon(message)
        failed = error_response(message, invalid=False)
        return [r or failed for r in responses], [None] * len(requests)
    per_request = [None] * len(requests)
    for index in range(len(requests)):
        if responses[index] is not None:
            continue
        mine = [image for image, owner in zip(images, owners) if owner == index]
        bad = next(((i, e) for i, e in enumerate(mine) if isinstance(e, ImageError)), None)
        if bad is not None:
            responses[index] = error_response(f"{IMAGE_BYTES}[{bad[0]}]: {bad[1]}", invalid=True)
        elif not mine:
            responses[index] = error_response(f"{IMAGE_BYTES} holds no image", invalid=True)
        else:
            per_request[index] = mine
    return responses, per_request


def decode_jpeg(data, mode: str, device: torch.device):
    """torchvision.io.decode_jpeg (nvJPEG on a GPU), torchvision imported at the first call: its import costs ~3.5 s
    of CPU, which a stub that never decodes tensors (every CPU instance by default) need not pay."""
    from torchvision.io import ImageReadMode, decode_jpeg as decode

    return decode(data, mode=ImageReadMode[mode], device=device)


class Preprocessor:
    """Encoded images -> normalized CHW float tensors on `device`, or the ImageError of each bad one.

    With `tensor_decode`, plain JPEGs (RGB or gray, no EXIF rotation, complete) are decoded together by
    torchvision's decode_jpeg on `device` (nvJPEG on a GPU), in chunks of at most `decode_budget` bytes of
    decoded pixels (by their headers' sizes), and transformed there, one transform call per group of
    same-size images (one resize kernel for a group instead of one per image); everything else, and
    any JPEG that decoder refuses, takes the PIL path, whose errors name the problem. With `host` (a CPU instance
    whose transform gives NumPy) the PIL path's arrays are returned as they are, and torch is never imported.
    """

    def __init__(self, transform, device: torch.device, tensor_decode: bool, workers: int = 1,
                 decode_budget: int = DEFAULT_GPU_DECODE_BUDGET_MB * 2**20, host: bool = False):
        self.transform, self.device, self.tensor_decode, self.host = transform, device, tensor_decode, host
        if tensor_decode:  # torchvision, loaded before any request, only where its decoder runs
            getattr(transform, "torchvision", lambda: None)()  # the transform of the decoder's tensors
        self.decode_budget = decode_budget  # bytes of decoded RGB pixels per batched decode_jpeg call
        # PIL releases the GIL while it decodes and resizes: a pool decodes a batch's images in parallel.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pil") if workers > 1 else None
        self.clock = StageClock()  # the fused model's measurement mode replaces it; off: no-ops

    def __call__(self, elements: list[bytes]) -> list:
        self.clock.lap("inputs")  # since the execute began: reading the requests' elements
        results, fast, pixels, slow = [None] * len(elements), [], [], []
        for index, data in enumerate(elements):
            try:
                count = tensor_pixels(data) if self.tensor_decode else 0
            except ImageError as exc:
                results[index] = detached(exc)
                continue
            if count:  # the header's size, read by the same open that checked the element
                fast.append(index)
                pixels.append(count)
            else:
                slow.append(index)
        # Each chunk is transformed before the next is decoded: only one chunk's full-size pixels at a time.
        for chunk in decode_chunks(pixels, self.decode_budget):
            indices = [fast[i] for i in chunk]
            decoded = []
            for index, image in zip(indices, self._decode([elements[i] for i in indices])):
                if image is None:  # the decoder refused it: PIL's path, whose errors name the problem
                    slow.append(index)
                else:
                    decoded.append((index, image))
            self.clock.lap("decode")
            for index, result in self._transform_grouped(decoded):
                results[index] = result
            self.clock.lap("transform")
        mapper = self._pool.map if self._pool is not None and len(slow) > 1 else map
        for index, result in zip(slow, mapper(self._pil_or_error, [elements[i] for i in slow])):
            results[index] = result
        self.clock.lap("pil")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # a CUDA fault raises here, not later
            self.clock.lap("preprocess_wait")
        return results

    def _transform_grouped(self, decoded: list[tuple[int, torch.Tensor]]) -> list[tuple[int, object]]:
        """(index, transformed image or its ImageError) for each decoded image: images of one size go through the
        transform together, as one batch (resize, crop and normalize act on each image of a batch alone, so every
        image gets what it would alone); a group whose batched call fails goes one by one."""
        groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for index, image in decoded:
            groups.setdefault(tuple(image.shape), []).append((index, image))
        done = []
        for members in groups.values():
            if len(members) > 1:
                try:
                    with torch.inference_mode():
                        batch = self.transform(torch.stack([image for _, image in members]))
                    done.extend((index, row) for (index, _), row in zip(members, batch.unbind(0)))
                    continue
                except Exception:  # e.g. an ImageError of one image's own: that one alone gets it
                    pass
            for index, image in members:
                try:
                    done.append((index, self._tensor_transform(image)))
                except ImageError as exc:
                    done.append((index, detached(exc)))
        return done

    def route(self, data: bytes) -> str:
        """"tensor" or "pil": which path `data` takes (for tests and logs)."""
        return "tensor" if self.tensor_decode and tensor_decodable(data) else "pil"

    def _decode(self, blobs: list[bytes]) -> list:
        """uint8 CHW tensors (None where the decoder refused one): one batched call, else one by one."""
        if not blobs:
            return []
        tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
        try:
            return list(decode_jpeg(tensors, mode="RGB", device=self.device))
        except Exception:  # one undecodable file fails the whole batched call
            pass
        images = []
        for tensor in tensors:  # only the culprit falls back to PIL
            try:
                images.append(decode_jpeg(tensor, mode="RGB", device=self.device))
            except Exception:
                images.append(None)
        return images

    def _tensor_transform(self, image: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.transform(image)

    def _pil_or_error(self, data: bytes):
        try:
            return self._pil(data)
        except ImageError as exc:
            return detached(exc)

    def _pil(self, data: bytes) -> torch.Tensor:
        image = decode(data)
        if self.host:
            return self.transform(image)
        with torch.inference_mode():
            return self.transform(image).to(self.device, non_blocking=True)
