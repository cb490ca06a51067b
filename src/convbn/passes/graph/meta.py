"""Whether a model's tensors hold values: the first parameter or buffer on the ``meta`` device.

A model built under ``torch.device("meta")`` (or with ``device="meta"``) has shapes and
dtypes but no values; ``model.to_empty(device=...)`` followed by an initialisation or a
``load_state_dict`` materialises it. :func:`convbn.fold` needs the values (it folds them),
:func:`convbn.convert` with ``example_inputs`` runs the model on them; both say so by name.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

__all__ = ["meta_tensor"]


def meta_tensor(model: nn.Module) -> Optional[str]:
    """The qualified name of ``model``'s first parameter or buffer on the meta device, or ``None``.

    Example:
        >>> meta_tensor(nn.Linear(2, 2, device="meta"))
        'weight'
    """
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if isinstance(t, Tensor) and t.is_meta:
            return name
    return None
