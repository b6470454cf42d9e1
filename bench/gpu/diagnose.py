"""Where does a served request's time go? Echo python models (CPU and GPU instances) vs resnet18, same client."""
import json, os, sys, tempfile, time
from pathlib import Path
import numpy as np
import tritonclient.grpc as grpcclient
from builder import cli
from server.triton import TritonServer
from perf.gpu_bench import run_load, _stats

ECHO = '''
import numpy as np, triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("LOGITS", np.ascontiguousarray(x.reshape(x.shape[0], -1)[:, :1000]))]))
        return out
'''
def main(kind='gpu', extra=()):
    repo = Path(tempfile.mkdtemp()) / "repo"
    assert cli.main(["--model", "resnet18", "--weights", "random", "--output", str(repo), "--kind", kind] + (["--precision", "fp16"] if kind == "gpu" else [])) == 0
    for group in (("CPU", "GPU") if kind == "gpu" else ("CPU",)):
        d = repo / f"echo_{group.lower()}"
        (d / "1").mkdir(parents=True)
        (d / "1" / "model.py").write_text(ECHO)
        (d / "config.pbtxt").write_text(f'''backend: "python"
    max_batch_size: 64
    input {{ name: "IMAGE" data_type: TYPE_FP32 dims: [3, 224, 224] }}
    output {{ name: "LOGITS" data_type: TYPE_FP32 dims: [1000] }}
    dynamic_batching {{ }}
    instance_group {{ kind: KIND_{group} count: 1 }}
    ''')
    server = TritonServer.local(repo)
    server.start(300)
    try:
        for model in [m for m in ("echo_cpu", "echo_gpu", "resnet18") if (repo / m).exists()]:
            for c in (1, 64):
                point = run_load(server.grpc_url, model, "tensor", {"shape": [1, 3, 224, 224]}, c, 2.0, 8)
                print(model, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in point.items()}), flush=True)
        # inline tensor (no shm), c=1, one thread here
        c = grpcclient.InferenceServerClient(server.grpc_url)
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        i = grpcclient.InferInput("IMAGE", list(x.shape), "FP32"); i.set_data_from_numpy(x)
        for model in ("echo_cpu", "resnet18"):
            for _ in range(5): c.infer(model, [i])
            t = time.perf_counter()
            for _ in range(50): c.infer(model, [i])
            print(model, "inline c=1 ms", round((time.perf_counter() - t) / 50 * 1000, 2), flush=True)
    finally:
        server.stop()


if __name__ == '__main__':
    main(*sys.argv[1:2])
