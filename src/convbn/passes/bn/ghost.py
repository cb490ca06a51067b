"""Ghost BatchNorm loops: one BatchNorm called on each piece of a tensor in a Python loop.

``torch.cat([self.bn(c) for c in x.chunk(k)])`` normalises each piece with its own batch
statistics and updates the running statistics once per piece. Symbolic tracing cannot
iterate the pieces of a tensor it has no value for, so the module holding the loop is left
untraced and its BatchNorm unfused and unfolded; the reports then say why in these words
rather than only that the module could not be traced. The loop is found in the source of
the module's ``forward`` (a ``for`` loop or a comprehension over ``.chunk``/``.split``/
``.unbind``/``.tensor_split`` of a tensor, or the ``torch.`` functions, whose body calls
``self.<bn>``); nothing is run.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Iterator, Optional, Tuple

from torch import nn

__all__ = ["ghost_bn_reason"]

_SPLITS = ("chunk", "split", "unbind", "tensor_split")


def _split_name(node: ast.AST) -> Optional[str]:
    """``"chunk"`` for ``x.chunk(k)`` / ``torch.chunk(x, k)`` (and the other splits), else ``None``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SPLITS:
        return node.func.attr
    return None


def _loops(tree: ast.AST) -> Iterator[Tuple[ast.AST, ast.AST]]:
    """``(iterable, body)`` of every ``for`` loop and comprehension of ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            yield node.iter, ast.Module(body=node.body, type_ignores=[])
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            for gen in node.generators:
                yield gen.iter, node.elt
        elif isinstance(node, ast.DictComp):
            for gen in node.generators:
                yield gen.iter, node.value


def _calls_self_attr(body: ast.AST, self_name: str, attr: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
               and isinstance(n.func.value, ast.Name) and n.func.value.id == self_name for n in ast.walk(body))


def ghost_bn_reason(owner: nn.Module, attr: str) -> Optional[str]:
    """Why BatchNorm child ``attr`` of ``owner`` is left, if ``owner.forward`` calls it in a loop
    over the pieces of a tensor (a ghost BatchNorm); ``None`` otherwise or without source.

    Args:
        owner: the module whose ``forward`` could not be traced.
        attr: the BatchNorm's attribute name on ``owner``.

    Returns:
        The reason, for reports, or ``None``.

    Example:
        >>> class Ghost(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bn = nn.BatchNorm2d(4)
        ...     def forward(self, x):
        ...         return torch.cat([self.bn(c) for c in x.chunk(2)])
        >>> ghost_bn_reason(Ghost(), "bn").startswith("ghost BatchNorm")
        True
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
        return None
    self_name = fn.args.args[0].arg  # ``self``, whatever it is called
    for iterable, body in _loops(fn):
        split = _split_name(iterable)
        if split is not None and _calls_self_attr(body, self_name, attr):
            return (f"ghost BatchNorm: {type(owner).__name__}.forward calls self.{attr} on each piece of a tensor's "
                    f"{split}() in a Python loop (batch statistics per piece, running statistics updated once per "
                    "piece); a fused chain normalises one tensor per call, and a symbolic trace cannot unroll a loop "
                    "over a tensor's pieces; left as is")
    return None
