"""NEXT STEP, NOT YET RUN (device time ran out): why NAME_preprocess's stub dies on a GPU instance.

Prints the stub's last log lines, then tries output_device=cpu (nvJPEG decode, CPU output) and
decode_device=cpu on the GPU instance, to tell a GPU-output fault from a decode fault.
"""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
import tritonclient.grpc as grpcclient
from builder import cli
from server.triton import TritonServer
from perf.gpu_bench import reload

repo = Path(tempfile.mkdtemp()) / "repo"
assert cli.main(["--model", "resnet18", "--weights", "random", "--output", str(repo), "--kind", "gpu",
                 "--max-batch-size", "8", "--instances", "1", "--decode-device", "gpu"]) == 0
server = TritonServer.local(repo, model_control="explicit").start(200)
jpg = open("clients/samples/chelsea.jpg", "rb").read()

def send():
    c = grpcclient.InferenceServerClient(server.grpc_url)
    t = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES"); t.set_data_from_numpy(np.array([[jpg]], dtype=object))
    return c.infer("resnet18_image", [t]).as_numpy("LOGITS")

try:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    pre_base = c.get_model_config("resnet18_preprocess", as_json=True)["config"]
    for output, decode in (("gpu", "gpu"), ("cpu", "gpu"), ("gpu", "cpu")):
        reload(c, "resnet18_preprocess", pre_base, parameters={"output_device": output, "decode_device": decode})
        try:
            out = send()
            t = time.perf_counter()
            for _ in range(50):
                send()
            print(f"output={output} decode={decode}: OK argmax {int(out.argmax())}, c=1 {(time.perf_counter() - t) / 50 * 1000:.2f} ms", flush=True)
        except Exception as exc:
            print(f"output={output} decode={decode}: FAILED {exc}", flush=True)
            time.sleep(2)
            lines = [l for l in list(server._tail) if "I1" not in l[:3]]
            print("\n".join(l[:400] for l in lines[-25:]), flush=True)
finally:
    server.stop()
