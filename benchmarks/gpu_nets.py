"""Library networks with per-sample norms as zero-argument builders, for ``bm_gpu.py``'s
``module:callable`` model specs (the nets of ``bm_norm_nets.py``, whose builders take the batch).

    python benchmarks/bm_gpu.py table --model benchmarks/gpu_nets.py:basicunet3d --batch-size 2 --image-size 96
    python benchmarks/bm_gpu.py table --model benchmarks/gpu_nets.py:diffusers_unet --batch-size 16 --image-size 128

Each library is imported when its builder is called (MONAI, diffusers, timm).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["basicunet3d", "convnext_atto", "diffusers_unet"]


class DiffusionStep(nn.Module):
    """``unet(x, t).sample`` at one timestep for the whole batch (a 0-dim timestep, which
    ``UNet2DModel`` broadcasts), so the module takes one tensor of any batch size."""

    def __init__(self, unet: nn.Module, timestep: int = 397) -> None:
        super().__init__()
        self.unet = unet
        self.register_buffer("timestep", torch.tensor(timestep), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x, self.timestep, return_dict=False)[0]


def diffusers_unet() -> nn.Module:
    """diffusers ``UNet2DModel`` (ResBlocks GroupNorm -> SiLU -> Conv), as ``bm_norm_nets.py``'s."""
    from diffusers import UNet2DModel

    unet = UNet2DModel(sample_size=64, in_channels=3, out_channels=3, block_out_channels=(32, 64, 128),
                       down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
                       layers_per_block=2, norm_num_groups=16)
    return DiffusionStep(unet)


def basicunet3d() -> nn.Module:
    """MONAI's 3-D ``BasicUNet`` (Conv -> InstanceNorm3d -> LeakyReLU), as ``bm_norm_nets.py``'s."""
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(16, 16, 32, 64, 128, 16))


def convnext_atto() -> nn.Module:
    """timm's ``convnext_atto`` (depthwise conv -> LayerNorm2d -> 1x1-conv MLP), 10 classes."""
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)
