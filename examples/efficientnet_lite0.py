"""EfficientNet-Lite0 in TorchServe's convention: one nn.Module class with a no-argument constructor."""
from efficientnet_lite_pytorch import EfficientNet
from efficientnet_lite_pytorch.utils import get_model_params


class EfficientNetLite0(EfficientNet):
    def __init__(self):
        blocks_args, global_params = get_model_params("efficientnet-lite0", None)
        super().__init__(blocks_args, global_params)
