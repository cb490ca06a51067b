"""A ``convert`` or ``fold`` that raises leaves the user's model exactly as it was.

Note: [a failed pass changes nothing]
Both passes rewrite the model in place as they go (``install``: forwards, fused modules as
attributes, replaced children and weights; ``fold(inplace=True)``: folded weights written
into the layers' own parameters; ``convert``: ``SyncBatchNorm`` children swapped, the
report attached). An exception anywhere in the pipeline -- an ``example_inputs`` the model
cannot run, a failed check, a bug, Ctrl-C -- must not leave the model half rewritten, as
PyTorch's own functions leave their arguments as they were when they raise. So the
pipeline runs inside :func:`transaction`: it records, for every module of the model, its
``__dict__`` and the contents of the dicts, sets and lists in it (children, parameters,
buffers, hooks, ...) and each parameter's and buffer's data; on an exception it puts every
one back, in place (the same dict objects, so hook handles keep working), then re-raises.
Tensor *values* are not copied: the passes never write into a tensor in place
(``StateSnapshot`` restores the buffers a check runs through); ``fold(inplace=True)``
replaces a parameter's data, which is put back.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import Tensor, nn

__all__ = ["transaction"]

_CONTAINERS = (dict, set, list)


class _ModuleState:
    """One module's attributes and the contents of its containers, as they were."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.attrs: Dict[str, Any] = dict(module.__dict__)
        self.contents: List[Tuple[Any, Any]] = [(v, _contents(v)) for v in self.attrs.values()
                                                if isinstance(v, _CONTAINERS)]

    def restore(self) -> None:
        d = self.module.__dict__
        for key in [k for k in d if k not in self.attrs]:
            del d[key]
        d.update(self.attrs)
        for container, contents in self.contents:
            _refill(container, contents)


def _contents(container: Any) -> Any:
    if isinstance(container, dict):
        return list(container.items())
    return list(container)


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(contents)
    elif isinstance(container, set):
        container.clear()
        container.update(contents)
    else:
        container[:] = contents


@contextlib.contextmanager
def transaction(model: nn.Module) -> Iterator[None]:
    """Run the block; if it raises, put ``model`` back as it was (Note: [a failed pass
    changes nothing]) and re-raise.

    Args:
        model: the user's model.

    Example:
        >>> with transaction(model):          # doctest: +SKIP
        ...     rewrite(model)                # raises: model is as it was
    """
    states = [_ModuleState(m) for m in model.modules()]
    tensors: Dict[int, Tuple[Tensor, Tensor]] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if isinstance(t, Tensor) and id(t) not in tensors:
                tensors[id(t)] = (t, t.data)
    try:
        yield
    except BaseException:
        for state in states:
            state.restore()
        with torch.no_grad():
            for t, data in tensors.values():
                if not _same_data(t, data):
                    t.data = data
        raise


def _same_data(t: Tensor, data: Tensor) -> bool:
    try:
        return (t.data_ptr() == data.data_ptr() and t.shape == data.shape and t.stride() == data.stride()
                and t.dtype == data.dtype and t.device == data.device)
    except RuntimeError:  # no storage (a meta or fake tensor): nothing was written into it
        return True
