"""A copy of a user's model that works like the model: ``copy.deepcopy`` with two repairs.

Note: [a copy that runs like the model]
``convert(inplace=False)`` and ``fold`` rewrite a copy, so the copy must compute what the
model computes. ``copy.deepcopy`` falls short in two ways seen on real models:

* **Hooks that close over the model.** A U-Net assembled with forward hooks
  (``enc.register_forward_hook(lambda m, i, o: self.store.__setitem__("e1", o))``): deepcopy
  copies ``self.store`` but not the function (functions are atomic to deepcopy), so the
  copy's hook writes into the *original's* store and the copy's decoder reads its own, empty
  one. Each hook of the copy that is a plain function whose closure holds an object that was
  copied is rebuilt over the copies (the same code, the cells pointing into the copy); bound
  methods deepcopy rebinds itself.
* **Tensors that refuse the deepcopy protocol.** A module that keeps a non-leaf tensor (a
  cached result computed in eval mode with grad on) makes deepcopy raise torch's "Only
  Tensors created explicitly by the user ... support the deepcopy protocol". Such tensors
  are not parameters or buffers and no pass writes into them: the copy shares them.
"""
from __future__ import annotations

import copy
import types
from typing import Any, Dict, Optional

from torch import nn

from .state_tensors import held_tensors

__all__ = ["model_copy", "rebind_hook_closures"]

#: the per-module hook tables whose functions may close over the model
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def model_copy(model: nn.Module, memo: Optional[Dict[int, Any]] = None) -> nn.Module:
    """``copy.deepcopy(model, memo)`` that shares the tensors deepcopy refuses and whose hooks
    close over the copy (Note: [a copy that runs like the model]).

    Args:
        model: the module to copy.
        memo: a deepcopy memo to start from (``id(obj) -> what the copy uses``), e.g. tensors
            to share.

    Returns:
        The copy.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> model_copy(net)[0] is net[0]
        False
    """
    memo = {} if memo is None else memo
    for i, t in held_tensors(model).items():
        if not t.is_leaf:  # refuses deepcopy; not a parameter or buffer, nothing writes into it
            memo.setdefault(i, t)
    clone = copy.deepcopy(model, memo)
    rebind_hook_closures(clone, memo)
    return clone


def _copied_cell_contents(fn: types.FunctionType, memo: Dict[int, Any]) -> Optional[tuple]:
    """New closure cells for ``fn`` pointing at the copies of what its cells hold, or ``None``
    where no cell holds a copied object."""
    if not fn.__closure__:
        return None
    changed = False
    cells = []
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        twin = memo.get(id(value), value)
        changed = changed or twin is not value
        cells.append(types.CellType(twin))
    return tuple(cells) if changed else None


def rebind_hook_closures(clone: nn.Module, memo: Dict[int, Any]) -> None:
    """In place: each hook of ``clone``'s modules that is a plain function closing over an
    object ``memo`` maps to a copy is replaced by the same function over the copy."""
    for m in clone.modules():
        for table in HOOK_TABLES:
            hooks = m.__dict__.get(table)
            if not isinstance(hooks, dict):
                continue
            for key, hook in list(hooks.items()):
                if not isinstance(hook, types.FunctionType):
                    continue
                cells = _copied_cell_contents(hook, memo)
                if cells is not None:
                    new = types.FunctionType(hook.__code__, hook.__globals__, hook.__name__, hook.__defaults__, cells)
                    new.__kwdefaults__ = hook.__kwdefaults__
                    new.__dict__.update(hook.__dict__)
                    new.__qualname__ = hook.__qualname__
                    hooks[key] = new
