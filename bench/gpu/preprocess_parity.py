"""GPU (nvJPEG + transforms on the device) vs PIL preprocessing on the test JPEGs: differences and top-1."""
import json
import sys

import torch
import torchvision

sys.path.insert(0, "tests")
from backends.preprocess import Preprocessor, decode  # noqa: E402
from test_preprocess_gpu import _jpegs  # noqa: E402

device = torch.device("cuda" if torch.cuda.is_available() and "--cpu" not in sys.argv else "cpu")
transform = torchvision.models.ResNet152_Weights.DEFAULT.transforms()
jpegs = _jpegs()
fast = Preprocessor(transform, device, tensor_decode=True)(list(jpegs.values()))
slow = [transform(decode(data)) for data in jpegs.values()]
torch.manual_seed(0)
model = torchvision.models.get_model("resnet152", weights=None).eval().to(device)
with torch.inference_mode():
    top_fast = model(torch.stack(fast).to(device)).argmax(1).tolist()
    top_slow = model(torch.stack(slow).to(device)).argmax(1).tolist()
diffs = {name: (f.cpu() - s).abs() for name, f, s in zip(jpegs, fast, slow)}
print(json.dumps({"device": str(device), "images": list(jpegs),
                  "max_abs_diff": {n: round(float(d.max()), 4) for n, d in diffs.items()},
                  "mean_abs_diff": {n: round(float(d.mean()), 5) for n, d in diffs.items()},
                  "top1_agreement": sum(a == b for a, b in zip(top_fast, top_slow)) / len(jpegs)}, indent=1))
