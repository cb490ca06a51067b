"""Rewritten containers their parent does not call: what the report says of them.

Note: [a container its parent does not call]
A module whose own forward cannot be traced has its children converted one by one, each
its own rewritten forward (``GraphForward``). Its forward may then reach a converted
container's children without calling the container (guided-diffusion's ``ResBlock``:
``norm, rest = self.out_layers[0], self.out_layers[1:]``): the container's graph, and the
chains in it, never run, and its modules run as the user's modules. The report says what
runs, so such a forward is marked ``bypassed`` (``report/live.py`` then lists its chains as
not running, with the reason), and its next call clears the mark. Known from:

* ``example_inputs``: convert's eager run on them records which modules are called
  (``check/step.py`` ``called_inputs``): a converted container of a parent that could not
  be traced, not called itself while modules under it are, is marked at convert time;
* without them, the untraceable parent is captured on its first call
  (``convert/first_call_capture.py``); where that capture fails too, its own forward runs on
  that call with every rewritten forward the parent reaches first (its children, through
  those without a forward of their own, ``ModuleList`` / ``ModuleDict``) marked before the
  call: the ones still marked after it did not run although their parent did.

No hook is set on the user's modules: the mark is the rewritten forward's own attribute.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Tuple

from torch import nn

from .graph_module import GraphForward, installed

__all__ = ["reached_forwards", "bypass_reason", "watched_call", "mark_if_bypassed"]


def reached_forwards(parent: nn.Module) -> List[GraphForward]:
    """The rewritten forwards ``parent``'s own forward reaches first: those of its children, and
    of their children where a child has no forward of its own (``ModuleList``, ``ModuleDict``)
    nor a forward ``convert`` set (a module captured on its first call watches its own)."""
    found: List[GraphForward] = []
    todo = list(parent.children())
    while todo:
        child = todo.pop(0)
        fwd = installed(child)
        if fwd is not None:
            found.append(fwd)
        elif "forward" not in child.__dict__ and type(child).forward is nn.Module.forward:
            todo.extend(child.children())
    return found


def bypass_reason(owner: nn.Module, seen: Tuple[str, str]) -> str:
    """The report's reason for a rewritten ``owner`` that did not run although its parent did
    (``seen``: where that was seen, and what else it may be: a parent's call that skips the
    module looks the same where nothing says its children were called)."""
    return (f"its parent calls its children, not it{seen[1]}: the rewritten {type(owner).__name__}'s forward "
            f"did not run when its parent's did ({seen[0]}); its modules run unfused where called")


@contextlib.contextmanager
def watched_call(parent: nn.Module) -> Iterator[None]:
    """Mark each rewritten forward ``parent`` reaches first (:func:`reached_forwards`) before
    a call of ``parent``'s own forward; each one that runs clears its mark, and those that did not
    run stay marked (Note: [a container its parent does not call]). Where the call raises,
    every mark is taken back."""
    fwds = [f for f in reached_forwards(parent) if not f.bypassed]
    for f in fwds:
        f.bypassed = bypass_reason(f.owner, ("on the parent's first call", " (or skips it)"))
    try:
        yield
    except BaseException:
        for f in fwds:
            f.bypassed = ""
        raise


def mark_if_bypassed(module: nn.Module, called: Callable[[nn.Module], bool]) -> None:
    """Mark ``module``'s rewritten forward where ``called`` (convert's eager run on
    ``example_inputs``) says the module was not called while a module under it was (Note: [a
    container its parent does not call])."""
    fwd = installed(module)
    inner = [m for m in module.modules() if m is not module]
    if fwd is None or called(module) or not any(called(m) for m in inner):
        return
    if any(installed(m) is not None and called(m) for m in inner):
        return  # the parent calls children that run rewrites of their own (an iterated Sequential of blocks)
    fwd.bypassed = bypass_reason(module, ("in the eager run on example_inputs", ""))
