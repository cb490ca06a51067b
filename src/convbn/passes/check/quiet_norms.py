"""A model's training-mode BatchNorms computing as they do, with their running statistics left unwritten.

Note: [the check's eager gradients with the statistics unwritten]
The check's eager step (check/eager_reference.py) needs the gradients of one training step,
and must leave the model's state as it was. A ``torch.nn`` BatchNorm in training mode
normalises with the batch's statistics; its running statistics only receive them
(``_BatchNorm.forward`` passes them to ``F.batch_norm`` and advances ``num_batches_tracked``
only where ``track_running_stats`` is set). With the flag cleared for the step, the module
computes the very same outputs and gradients (the same kernel on the same batch statistics:
bit for bit on the CPU) and writes none of its buffers, so no copy of them need be alive to
put them back. Only modules whose forward is ``_BatchNorm.forward`` itself are quietened:
a subclass with a forward of its own (timm's norm + activation layers, ``SyncBatchNorm``), an
``InstanceNorm`` (it passes its running statistics whatever the flag says) or any other
buffer keeps the snapshot's copy, as before. The flag is put back after the block. A
quietened buffer that other code writes (a parent's ``F.batch_norm`` on it) no longer holds
its copies' bits after the forward, so its copies are not lent (Note: [copies lent while a
step cannot write them] in buffer_copies.py).

While quietened, the flag is a false value that counts how often it is read
(:class:`QuietFlag`): ``_BatchNorm.forward`` reads it on every call, so the count says whether
a quietened module ran in a stretch of the step. A backward that runs one (a checkpoint
recomputing its block) would have written the statistics a second time in eager's step, which
a forward without autograd does not reproduce: the caller then takes eager's step whole.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["QuietFlag", "Quiet", "statistics_unwritten"]


class QuietFlag:
    """A false ``track_running_stats`` that counts its reads (Note: [the check's eager gradients
    with the statistics unwritten])."""

    def __init__(self) -> None:
        self.reads = 0

    def __bool__(self) -> bool:
        self.reads += 1
        return False

    def __repr__(self) -> str:
        return "False"


@dataclass
class Quiet:
    """The quietened BatchNorms' buffers, and the flag they read."""

    buffers: List[Tensor]
    flag: QuietFlag


def _quietable(m: nn.Module) -> bool:
    """A training-mode BatchNorm tracking running statistics whose forward is ``_BatchNorm``'s own."""
    return (isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward and "forward" not in m.__dict__
            and m.training and m.track_running_stats)


@contextlib.contextmanager
def statistics_unwritten(model: nn.Module) -> Iterator[Quiet]:
    """In the block, every quietened BatchNorm of ``model`` (Note: [the check's eager gradients
    with the statistics unwritten]) leaves its running statistics and ``num_batches_tracked``
    as they are; yields those buffers and the flag they read.

    Example:
        >>> with statistics_unwritten(model) as quiet:   # doctest: +SKIP
        ...     model(x).sum().backward()                  # running statistics unchanged
    """
    quiet = [m for m in model.modules() if _quietable(m)]
    flag = QuietFlag()
    for m in quiet:
        m.track_running_stats = flag
    try:
        yield Quiet([b for m in quiet for b in m.buffers(recurse=False)], flag)
    finally:
        for m in quiet:
            m.track_running_stats = True
