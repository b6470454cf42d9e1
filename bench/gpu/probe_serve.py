"""Probe: the current code served on KIND_GPU through the wheel's tritonserver (gRPC client)."""
import sys, time, tempfile
from pathlib import Path
import numpy as np
import tritonclient.grpc as grpcclient
from builder import cli
from builder.serve import TritonServer, free_port

repo = Path(tempfile.mkdtemp()) / "repo"
assert cli.main(["--model", "resnet18", "--weights", "random", "--output", str(repo), "--kind", "gpu",
                 "--engine", "torch"]) == 0
server = TritonServer(repo, free_port(), free_port(), free_port())
t = time.time()
try:
    server.start(300)
    print("ready in", round(time.time() - t, 1), "s")
    c = grpcclient.InferenceServerClient(server.grpc_url)
    x = np.random.default_rng(0).standard_normal((4, 3, 224, 224)).astype(np.float32)
    i = grpcclient.InferInput("IMAGE", list(x.shape), "FP32"); i.set_data_from_numpy(x)
    print("logits", c.infer("resnet18", [i]).as_numpy("LOGITS").shape)
    jpg = open("clients/samples/chelsea.jpg", "rb").read()
    b = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES"); b.set_data_from_numpy(np.array([[jpg]], dtype=object))
    print("image", c.infer("resnet18_image", [b]).as_numpy("LOGITS").shape)
finally:
    server.stop()
    print("".join(l + "\n" for l in list(server._tail)[-40:]))
