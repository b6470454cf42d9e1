"""Probe: ResNet-152 in-process speeds (fp32/fp16/bf16, graphs), GPU JPEG decode, and a served GPU smoke test."""
import io, json, os, sys, time, tempfile
import numpy as np, torch, torchvision
from pathlib import Path

dev = torch.device("cuda", 0)
torch.backends.cudnn.benchmark = True

def timeit(fn, n=30):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n

torch.manual_seed(0)
m = torchvision.models.resnet152().eval().to(dev)
res = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    mm = m.to(dtype=dtype, memory_format=torch.channels_last)
    for b in (1, 8, 32, 64, 128):
        x = torch.randn(b, 3, 224, 224, device=dev, dtype=dtype).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            t = timeit(lambda: mm(x))
        res[f"{dtype} b{b} eager"] = round(b / t)
        # graphs
        with torch.inference_mode():
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3): mm(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = mm(x)
            t = timeit(lambda: g.replay())
        res[f"{dtype} b{b} graph"] = round(b / t)
        print(dtype, b, res[f"{dtype} b{b} eager"], res[f"{dtype} b{b} graph"], flush=True)
    m = m.float()
print(json.dumps(res, indent=1))

# GPU jpeg decode
from PIL import Image
img = Image.fromarray((np.random.default_rng(0).random((480, 640, 3)) * 255).astype(np.uint8))
buf = io.BytesIO(); img.save(buf, format="JPEG", quality=90); data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
from torchvision.io import decode_jpeg
try:
    out = decode_jpeg([data] * 32, device="cuda")
    print("gpu decode ok", out[0].shape, out[0].device)
    t = timeit(lambda: decode_jpeg([data] * 32, device="cuda"), 10)
    print("gpu decode 32x640x480:", round(32 / t), "img/s")
    t = timeit(lambda: [decode_jpeg(data) for _ in range(32)], 5)
    print("cpu decode 32x640x480:", round(32 / t), "img/s")
except Exception as e:
    print("gpu decode FAILED", type(e).__name__, e)
