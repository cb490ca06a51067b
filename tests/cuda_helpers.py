"""What the CUDA test files share: like-with-like numerics on the GPU and a one-process NCCL group."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

import torch

__all__ = ["exact_cuda_numerics", "one_process_nccl"]


@contextlib.contextmanager
def exact_cuda_numerics() -> Iterator[None]:
    """No TF32 (eager and fused may get different conv algorithms, whose TF32 rounding differs by
    ~1e-3) and deterministic cuDNN (its float64 weight gradients otherwise accumulate with atomics,
    which gradcheck's reentrancy check sees); the previous settings are put back."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_process_nccl(device: torch.device) -> Iterator[None]:
    """A process group of world size 1 over NCCL on ``device``, destroyed on exit."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        yield
    finally:
        dist.destroy_process_group()
