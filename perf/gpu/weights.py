"""The bench's model weights: seeded random ones that behave as trained weights do in fp16."""
from __future__ import annotations

from pathlib import Path


def calibrated_weights(model: str, folder: Path, device: str, seed: int = 0) -> Path:
    """Seeded random weights whose BatchNorm statistics come from a few random batches (a train-mode forward), as
    training leaves them, saved as a state_dict for build-repo --weights FILE. torchvision's random init in eval mode
    gives ResNet-152 logits of ~1e7, past fp16's 65504: every fp16 answer was inf on the H100 (2026-11-27), which
    says nothing of serving. Normalized activations keep the logits small; the compute measured is the same."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    net = torchvision.models.get_model(model, weights=None).to(device)
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over the batches below
    net.train()
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for _ in range(4):
            net(torch.randn(8, 3, 224, 224, device=device, generator=generator))
    path = folder / f"{model}-calibrated-seed{seed}.pt"
    torch.save({name: value.cpu() for name, value in net.eval().state_dict().items()}, path)
    return path
