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
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

from .._compat import mod_tracker_module

__all__ = ["releasing_mod_tracker"]


@contextlib.contextmanager
def _handles_into(handles: List[Any]) -> Iterator[None]:
    """Within the block, keep the handle of every hook ``ModTracker`` registers."""
    mod_tracker = mod_tracker_module()
    register = mod_tracker.register_multi_grad_hook

    def keeping(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = keeping  # type: ignore[assignment]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register  # type: ignore[assignment]


def releasing_mod_tracker() -> Any:
    """A ``torch.distributed._tools.mod_tracker.ModTracker`` whose gradient hooks are
    removed when its block ends (Note: [a module tracker that leaves nothing alive]).

    Use it around a whole step: a backward run after the block is not attributed to modules.

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
            with _handles_into(self._grad_hook_handles):
                super()._fw_pre_hook(mod, input)

        def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
            with _handles_into(self._grad_hook_handles):
                super()._fw_post_hook(mod, input, output)

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            handles, self._grad_hook_handles = self._grad_hook_handles, []
            for handle in handles:
                handle.remove()

    return ReleasingModTracker()
