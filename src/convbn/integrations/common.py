"""Converting the model a training framework holds: :func:`convert_submodules` (torch only)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from torch import nn

from ..passes.convert.api import convert
from ..passes.report.convert_report import ConvertReport

__all__ = ["convert_submodules", "has_batchnorm", "is_converted"]


def has_batchnorm(module: nn.Module) -> bool:
    """``True`` when ``module`` or a descendant is a BatchNorm (``nn.modules.batchnorm._BatchNorm``, subclasses too)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def is_converted(module: nn.Module) -> bool:
    """``True`` when ``module`` is the result of :func:`convbn.convert` (its ``convbn_report`` is a
    :class:`convbn.ConvertReport`; :func:`convbn.fold`'s result carries a ``FoldReport`` there)."""
    return isinstance(getattr(module, "convbn_report", None), ConvertReport)


def convert_submodules(parent: nn.Module, names: Optional[Sequence[str]] = None, **convert_kwargs: Any) -> List[str]:
    """Replace children of ``parent`` by :func:`convbn.convert` of them, in place; returns their names.

    ``parent`` is the framework's wrapper (a ``LightningModule``, a trainer's model holder):
    its own methods (``training_step`` ...) are not a network to trace, its children are.
    Children already converted are left as they are, so calling this twice (a resumed run,
    a second ``fit``) converts nothing more.

    Args:
        parent: the module whose children are converted.
        names: the children to convert (default: every child holding a BatchNorm).
        **convert_kwargs: passed to :func:`convbn.convert` (``strategy``, ``example_inputs``, ...).

    Returns:
        The names of the children converted by this call.

    Raises:
        ValueError: a name in ``names`` is not a child of ``parent``.

    Example:
        >>> class Lit(nn.Module):                      # a LightningModule in real use
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> lit = Lit()
        >>> convert_submodules(lit)
        ['net']
    """
    children = dict(parent.named_children())
    if names is None:
        names = [n for n, c in children.items() if has_batchnorm(c)]
    else:
        unknown = [n for n in names if n not in children]
        if unknown:
            raise ValueError(f"{type(parent).__name__} has no child module(s) {unknown}; its children are "
                             f"{sorted(children)}")
    done: List[str] = []
    for name in names:
        child = children[name]
        if is_converted(child):
            continue
        setattr(parent, name, convert(child, **convert_kwargs))
        done.append(name)
    return done
