"""Run gathered request tensors as one batch on one device: staging, normalizing, precision, CUDA graphs.

build-repo copies this file beside the classifier's model.py (Triton puts the version folder on
sys.path); perf imports it as backends.batch_runner to time the very same path in-process.
"""
from __future__ import annotations

import torch

try:  # in Triton: the version folder, which holds copies of common/precision.py and stage_clock.py, is on sys.path
    from precision import TORCH_DTYPES, check
    from stage_clock import StageClock
except ImportError:
    from backends.stage_clock import StageClock
    from common.precision import TORCH_DTYPES, check

PRECISIONS = {name: getattr(torch, dtype) for name, dtype in TORCH_DTYPES.items()}  # the torch dtype of each


class BatchRunner:
    """engine(batch) -> logits on `device`, fed from CPU or GPU parts; returns CPU float32 logits.

    On a GPU every batch pads up to a bucket size whose kernels were chosen (cudnn.benchmark) and,
    with `cuda_graphs`, captured in initialize: a replay launches ResNet-152's ~500 kernels at once
    instead of one Python call each (b=8 fp32 on an H100: 535 -> 1911 img/s). The padding rows are
    computed and dropped; rows do not interact in an eval-mode classifier, so each request's rows are
    exactly what an unpadded forward gives.

    Parts may be float32 (normalized), float16 (normalized; cast here) or uint8 (resized and cropped
    pixels; normalized here as (x / 255 - mean) / std, with `mean_std` from the config). Compact parts
    cross to the GPU as they came, in 2x / 4x fewer bytes, and are converted there.
    """

    def __init__(self, engine, device: torch.device, sample_shape: tuple[int, ...], precision: str = "fp32",
                 cuda_graphs: bool = False, buckets: list[int] | None = None, channels_last: bool = True,
                 graph_ok: bool = True, mean_std: tuple[list[float], list[float]] | None = None):
        self.gpu = device.type == "cuda"
        # The runner casts rows for the graph engines (torch, torchscript); the others take fp32 rows.
        check(precision, "torch", "gpu" if self.gpu else "cpu")
        self.engine, self.device, self.sample_shape = engine, device, tuple(sample_shape)
        self.dtype = PRECISIONS[precision]
        self.memory_format = torch.channels_last if channels_last and len(sample_shape) == 3 else torch.contiguous_format
        self.buckets = sorted(buckets or []) if self.gpu else []
        self.cuda_graphs = bool(cuda_graphs and self.gpu and graph_ok)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self.mean_std = mean_std
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # mean, std [C, 1, 1] per device
        self._compact_pinned: dict[torch.dtype, torch.Tensor] = {}  # host staging of fp16 / uint8 rows
        self.clock = StageClock()  # the model's measurement mode replaces it (stage_timing=1); off: no-ops
        if self.gpu:
            largest = self.buckets[-1] if self.buckets else 1
            # Pinned host staging: one non-blocking H2D copy per batch instead of one per request.
            self._pinned = torch.empty((largest, *self.sample_shape), dtype=torch.float32).pin_memory()
            self._landing = torch.empty((largest, *self.sample_shape), dtype=torch.float32, device=device)
            self.stream = torch.cuda.Stream(device)

    @property
    def largest(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def warm_up(self) -> None:
        """Choose kernels for (and capture) every bucket now, so no request pays for it later."""
        if not self.gpu:
            self.run([torch.zeros((1, *self.sample_shape))])
            return
        with torch.cuda.stream(self.stream), torch.inference_mode():
            pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
            for size in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool
                static = torch.zeros((size, *self.sample_shape), device=self.device, dtype=self.dtype)
                static = static.contiguous(memory_format=self.memory_format)
                self._inputs[size] = static
                for _ in range(3):  # cudnn.benchmark tries its algorithms on the first calls of a shape
                    self.engine(static)
                if self.cuda_graphs:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                        out = self.engine(static)
                    self._graphs[size] = (graph, static, out)
            self.stream.synchronize()

    def run(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Logits (CPU, float32) for the parts' rows in order; raises on any device error."""
        total = sum(part.shape[0] for part in parts)
        if not self.gpu:
            if all(part.dtype == torch.float32 for part in parts):
                batch = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:
                batch = torch.empty((total, *self.sample_shape), dtype=torch.float32)
                offset = 0
                for part in parts:
                    self._convert(part, batch[offset:offset + part.shape[0]])
                    offset += part.shape[0]
            with torch.inference_mode():  # bf16: the cast and the layout change are one copy
                batch = batch.to(self.dtype, memory_format=self.memory_format)
                self.clock.lap("staging")
                logits = self.engine(batch).float()
                self.clock.lap("forward")
                return logits
        pieces, start = [], 0
        while start < total:  # Triton never forms more than max_batch_size; a caller might
            size = min(total - start, self.largest or total)
            pieces.append(self._run_gpu(_rows(parts, start, size), size))
            start += size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _run_gpu(self, parts: list[torch.Tensor], total: int) -> torch.Tensor:
        bucket = next((b for b in self.buckets if b >= total), total)
        ordered_after_producers(self.stream, parts)
        clock = self.clock
        with torch.cuda.stream(self.stream), torch.inference_mode():
            staged = self._pack(parts, total)  # host: the CPU rows into pinned memory
            clock.lap("staging")
            copying = clock.event(self.stream)
            landing = self._gather(parts, total, staged)  # device: copies in, normalized into one batch
            forwarding = clock.event(self.stream)
            if bucket in self._graphs:
                graph, static, out = self._graphs[bucket]
                static[:total].copy_(landing)  # cast + layout on the device, into the graph's input
                graph.replay()
            else:
                static = self.static_input(bucket)
                static[:total].copy_(landing)
                out = self.engine(static)
            clock.lap("launch")
            returning = clock.event(self.stream)
            # One cast and one D2H copy per batch (into pageable memory: the copy waits for the
            # stream). It is the one wait per batch, so a CUDA fault surfaces here, inside the caller's
            # error handling, never as a response with an unfilled buffer.
            logits = out[:total].float().cpu()
            returned = clock.event(self.stream)
            self.stream.synchronize()
            clock.lap("wait")
        clock.span("device_h2d", copying, forwarding)
        clock.span("device_forward", forwarding, returning)
        clock.span("device_d2h", returning, returned)
        return logits

    def static_input(self, bucket: int) -> torch.Tensor:
        """The device-resident input a `bucket`-row forward reads (the graph's own where one is captured)."""
        if bucket in self._graphs:
            return self._graphs[bucket][1]
        static = self._inputs.get(bucket)
        if static is None:
            static = torch.zeros((bucket, *self.sample_shape), device=self.device, dtype=self.dtype)
            static = static.contiguous(memory_format=self.memory_format)
            if bucket in self.buckets:  # only the buckets' are kept: without buckets every size would be
                self._inputs[bucket] = static
        return static

    def bucket_for(self, rows: int) -> int:
        """The batch size a forward of `rows` rows runs at (padded up to a bucket on a GPU)."""
        return next((b for b in self.buckets if b >= rows), rows)

    def forward_on_device(self, rows: int) -> torch.Tensor:
        """The engine alone on a batch already on the device: `rows` padded to its bucket, the captured graph
        where there is one, no copies in or out (perf's reference for the served path). Queued on the runner's
        stream; the caller synchronizes."""
        bucket = self.bucket_for(rows)
        if not self.gpu:
            with torch.inference_mode():
                return self.engine(self.static_input(bucket))
        with torch.cuda.stream(self.stream), torch.inference_mode():
            if bucket in self._graphs:
                graph, _, out = self._graphs[bucket]
                graph.replay()
                return out
            return self.engine(self.static_input(bucket))

    def _pack(self, parts: list[torch.Tensor], total: int) -> dict:
        """Host staging: fp32 CPU rows into the pinned batch at their offsets, other CPU dtypes packed into pinned
        memory of their own dtype (each crosses in one copy); {dtype: pinned rows} for _gather."""
        staged = {}
        fp32 = [part for part in parts if part.device.type == "cpu" and part.dtype == torch.float32]
        if fp32:
            pinned = self._pinned[:total] if total <= self._pinned.shape[0] else \
                torch.empty((total, *self.sample_shape), dtype=torch.float32).pin_memory()
            offset = 0
            for part in parts:
                if part.device.type == "cpu" and part.dtype == torch.float32:
                    # The previous batch's H2D from this buffer finished: run() synchronized before returning.
                    pinned[offset:offset + part.shape[0]].copy_(part)
                offset += part.shape[0]
            staged[torch.float32] = pinned
        for dtype in {part.dtype for part in parts if part.device.type == "cpu" and part.dtype != torch.float32}:
            chosen = [part for part in parts if part.device.type == "cpu" and part.dtype == dtype]
            rows = sum(part.shape[0] for part in chosen)
            pinned = self._compact_pinned.get(dtype)
            if pinned is None or pinned.shape[0] < rows:
                pinned = torch.empty((max(rows, self.largest), *self.sample_shape), dtype=dtype).pin_memory()
                self._compact_pinned[dtype] = pinned
            at = 0
            for part in chosen:
                pinned[at:at + part.shape[0]].copy_(part)
                at += part.shape[0]
            staged[dtype] = pinned[:rows]
        return staged

    def _gather(self, parts: list[torch.Tensor], total: int, staged: dict) -> torch.Tensor:
        """Device: the staged rows and the GPU-resident parts, normalized float32, in order, in one landing batch."""
        landing = self._landing[:total] if total <= self._landing.shape[0] else \
            torch.empty((total, *self.sample_shape), dtype=torch.float32, device=self.device)
        if torch.float32 in staged:
            landing.copy_(staged[torch.float32], non_blocking=True)
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.shape[0])
        for dtype, pinned in staged.items():
            if dtype == torch.float32:
                continue
            device_rows = pinned.to(self.device, non_blocking=True)  # one H2D copy per dtype
            at = 0
            for i, part in enumerate(parts):
                if part.device.type == "cpu" and part.dtype == dtype:
                    rows = part.shape[0]
                    self._convert(device_rows[at:at + rows], landing[offsets[i]:offsets[i + 1]])
                    at += rows
        for i, part in enumerate(parts):
            if part.device.type != "cpu":  # already on a GPU (ensemble, CUDA shared memory): gather on the device
                self._convert(part, landing[offsets[i]:offsets[i + 1]])
        return landing

    def _convert(self, part: torch.Tensor, out: torch.Tensor) -> None:
        """out = the part as normalized float32, on out's device: uint8 pixels are normalized, fp16 cast."""
        if part.dtype != torch.uint8:
            out.copy_(part, non_blocking=True)
            return
        if self.mean_std is None:
            raise ValueError("uint8 images need the config's mean and std, which this model records none of")
        if out.device not in self._stats:
            self._stats[out.device] = tuple(torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).to(out.device)
                                            for values in self.mean_std)
        mean, std = self._stats[out.device]
        torch.div(part, 255, out=out)  # as torchvision's ToTensor + Normalize: x / 255, - mean, / std
        out.sub_(mean).div_(std)


def _rows(parts: list[torch.Tensor], start: int, size: int) -> list[torch.Tensor]:
    """The parts' rows [start, start + size) as a list of views."""
    chosen, offset = [], 0
    for part in parts:
        low, high = max(start - offset, 0), min(start + size - offset, part.shape[0])
        if low < high:
            chosen.append(part[low:high])
        offset += part.shape[0]
    return chosen


def ordered_after_producers(stream, parts: list[torch.Tensor]) -> None:
    """Make `stream` wait for the work the callers queued on their current stream (the fused model stacks
    its decoded images there, python_backend hands GPU inputs over on it), and tell the caching allocator
    those tensors are in use on `stream` too, so their memory is not handed out again before it is done."""
    gpu = [part for part in parts if part.device.type == "cuda"]
    if not gpu:
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for part in gpu:
        part.record_stream(stream)
