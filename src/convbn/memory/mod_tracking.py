"""torch's ``ModTracker`` that removes the autograd hooks it installed when its block ends.

# Note: [a module tracker that leaves nothing alive]
# ``ModTracker`` tells which module's forward or backward is running: module hooks for
# forward, and for backward ``register_multi_grad_hook`` on each module's inputs and
# outputs. In ``"all"`` mode that function's hook closes over the grad_fns of the tensors it
# is registered on, and the hook is stored on one of those same grad_fns: a cycle through a
# C++ autograd node, which Python's collector cannot see into. torch discards the handles,
# so the cycle outlives the block; it holds a node's saved tensors and, through its
# AccumulateGrad edges, the module's parameters (Conv -> BN -> ReLU keeps the convolution's
# weight and bias alive). A measurement on a copy of the user's model then kept the copy's
# parameters for the life of the process.
# The trick: keep the handles while the tracker's own hooks run, and remove them when the
# block ends. The block holds the whole step (forward, loss, backward), so every hook has
# fired by then; removing a hook from its node breaks the cycle.

# Note: [a hook on a stale view crashes the process]
# ``register_multi_grad_hook(..., mode="any")`` (what ``ModTracker`` puts on every module's
# outputs) calls ``Tensor.register_hook`` on each tensor without reading its ``grad_fn`` first.
# On a view whose base was changed in place through another alias (a spectrogram-augmentation
# module that masks ``x[:, :, a:b].zero_()`` and returns its view ``x``), reading ``grad_fn``
# is what refreshes the view's autograd history; ``register_hook`` before that refresh
# writes into a hook table the refresh then clears, and the process dies with a segfault
# (pytorch/pytorch#196459, torch 2.9 to 2.14). Reading ``grad_fn`` of every tensor before
# the registration, as ``register_multi_grad_hook``'s ``"all"`` mode already does, is
# torch's own fix, and safe on any tensor (a leaf answers ``None``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

import torch

from .._compat import mod_tracker_module

__all__ = ["releasing_mod_tracker", "refresh_view_history"]


def refresh_view_history(tensors: Any) -> None:
    """Read ``grad_fn`` of every tensor in ``tensors`` so that a view changed in place through
    another alias has its autograd history brought up to date before a hook is registered on
    it (Note: [a hook on a stale view crashes the process])."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            _ = t.grad_fn


class _NoHook:
    def remove(self) -> None:
        pass


def _may_hold(tensors: Any, mode: str) -> bool:
    """Whether a multi-grad hook may hold a gradient past its own call: ``"all"`` over two or more
    tensors keeps each gradient until the last one arrives (Note: [a module tracker for the
    forward only])."""
    return mode == "all" and sum(isinstance(t, torch.Tensor) for t in tensors) > 1


@contextlib.contextmanager
def _handles_into(handles: List[Any], backward: bool = True) -> Iterator[None]:
    """Within the block, keep the handle of every hook ``ModTracker`` registers; ``backward=False``:
    register none (Note: [a module tracker for the forward only])."""
    mod_tracker = mod_tracker_module()
    register = mod_tracker.register_multi_grad_hook

    def keeping(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not backward and not _may_hold(tensors, kwargs.get("mode", "all")):
            return _NoHook()
        refresh_view_history(tensors)
        handle = register(tensors, *args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = keeping  # type: ignore[assignment]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register  # type: ignore[assignment]


# Note: [a module tracker for the forward only]
# ``ModTracker`` learns which module's backward runs from gradient hooks it registers on every
# module's inputs and outputs in the forward (``register_multi_grad_hook``: 884 of them in the
# planner's four recorded steps of ResNet-50, each a tensor hook per tensor). A reader that never
# asks which module's backward runs (the planner tells a chain's backward by its autograd node:
# Note: [the saves read off the recorded step] in passes/plan/plan_inputs.py) records without
# them: the forward is named as before, the backward is outside every module (``parents`` is
# ``{"Global"}`` there). One kind of those hooks is kept: the one on a module's inputs waits for
# all their gradients (``mode="all"``) and holds each until the last arrives, so on a module called
# with two or more tensors (a DenseNet layer's list of features) it keeps gradients alive that the
# step without it would have freed (DenseNet-BC 32x32 b8: 32 KiB more in its backward). Kept, the
# recorded bytes are those of the step with every hook, to the byte (tests/test_lean_meter.py); a
# hook over one tensor, or on outputs (``mode="any"``), holds nothing past its own call.
def releasing_mod_tracker(backward: bool = True) -> Any:
    """A ``torch.distributed._tools.mod_tracker.ModTracker`` whose gradient hooks are
    removed when its block ends (Note: [a module tracker that leaves nothing alive]).

    Use it around a whole step: a backward run after the block is not attributed to modules.

    Args:
        backward: tell which module's backward runs; ``False``: the forward only, no gradient
            hooks (Note: [a module tracker for the forward only]).

    Returns:
        A ``ModTracker`` instance (a subclass), used exactly as torch's.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with releasing_mod_tracker() as tracker:
        ...     net(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> tracker.parents
        {'Global'}
    """
    class ReleasingModTracker(mod_tracker_module().ModTracker):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self._grad_hook_handles: List[Any] = []

        def _fw_pre_hook(self, mod: Any, input: Any) -> None:
            with _handles_into(self._grad_hook_handles, backward):
                super()._fw_pre_hook(mod, input)

        def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
            with _handles_into(self._grad_hook_handles, backward):
                super()._fw_post_hook(mod, input, output)

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            handles, self._grad_hook_handles = self._grad_hook_handles, []
            for handle in handles:
                handle.remove()

    return ReleasingModTracker()
