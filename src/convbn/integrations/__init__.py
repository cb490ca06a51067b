"""Where users train: helpers for the training loops people use.

Importing this package imports no third-party library; each module imports its own lazily
and raises ``ImportError`` naming the package to install:

* :mod:`convbn.integrations.common`: :func:`convert_submodules`, the one call every recipe
  makes (torch only);
* :mod:`convbn.integrations.lightning`: :class:`~convbn.integrations.lightning.ConvertCallback`
  for PyTorch Lightning (``pip install lightning``);
* Hugging Face ``transformers.Trainer`` and ``accelerate``: no helper needed; convert the
  model (built from its config or ``from_pretrained``) before the Trainer or
  ``Accelerator.prepare`` gets it. ``save_pretrained`` / ``from_pretrained`` work unchanged
  both ways (a converted model has the same ``state_dict`` keys), and
  :func:`convbn.fused_modules` sees through accelerate's mixed-precision forward;
* trainers that build the model themselves, MONAI's engines, EMA copies: recipes in the
  documentation's guides ("Your training loop" and the pages beside it).

The rule all of them follow: convert the bare model
once, before anything wraps or copies it (DDP / FSDP, ``torch.compile``, an EMA copy,
``SyncBatchNorm`` conversion). The optimizer may be built before or after: the converted
model's parameters are the model's own objects.
"""
from .common import convert_submodules, has_batchnorm

__all__ = ["convert_submodules", "has_batchnorm"]
