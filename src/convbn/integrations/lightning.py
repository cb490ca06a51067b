"""PyTorch Lightning: :class:`ConvertCallback` converts the LightningModule's networks in ``setup``.

Lightning calls a callback's ``setup`` before it restores a checkpoint into the module,
before ``configure_optimizers`` and before the strategy wraps the module (DDP), so the
converted networks are what every later step sees: the checkpoint loads into them (same
``state_dict`` keys), the optimizer holds their parameters (the model's own objects), DDP
wraps them, ``precision="bf16-mixed"`` runs them under autocast.

A network built in ``configure_model`` (Lightning's hook for large models) does not exist
yet in ``setup``: convert it at the end of ``configure_model`` instead, with
``convbn.integrations.convert_submodules(self)``.

Example:
    >>> import lightning.pytorch as pl                                    # doctest: +SKIP
    >>> from convbn.integrations.lightning import ConvertCallback         # doctest: +SKIP
    >>> trainer = pl.Trainer(callbacks=[ConvertCallback()], precision="bf16-mixed")  # doctest: +SKIP
    >>> trainer.fit(lit_module, datamodule)                               # doctest: +SKIP
"""
from __future__ import annotations

import importlib
from typing import Any, List, Optional, Sequence

from .common import convert_submodules

__all__ = ["ConvertCallback"]


def _lightning() -> Any:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ImportError("convbn.integrations.lightning needs PyTorch Lightning; install it with `pip install lightning`")


_pl = _lightning()


class ConvertCallback(_pl.Callback):  # type: ignore[misc,name-defined]
    """Convert the LightningModule's networks with :func:`convbn.convert` when training sets up.

    Args:
        names: the LightningModule's children to convert (default: every child holding a BatchNorm).
        **convert_kwargs: passed to :func:`convbn.convert` (``strategy``, ``memory_budget`` ...).

    Attributes:
        converted: the names converted by the last ``setup``.
    """

    def __init__(self, names: Optional[Sequence[str]] = None, **convert_kwargs: Any) -> None:
        super().__init__()
        self.names = None if names is None else list(names)
        self.convert_kwargs = convert_kwargs
        self.converted: List[str] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's hook: convert for ``fit`` only (validation / test / predict run eval BatchNorm)."""
        if stage != "fit":
            return
        if getattr(trainer.strategy, "_layer_sync", None) is not None:
            raise ValueError("ConvertCallback with Trainer(sync_batchnorm=True) is not supported: Lightning would "
                             "swap the converted layers' BatchNorms after conversion; convert the model after "
                             "torch.nn.SyncBatchNorm.convert_sync_batchnorm yourself instead")
        self.converted = convert_submodules(pl_module, self.names, **self.convert_kwargs)
