"""Only ``convbn/_compat.py`` reads private torch names (Note: [one door to private torch]).

The rule, checked on the source with :mod:`ast` (nothing imported or run):

* a *private torch name* is a dotted name under ``torch`` with a segment that starts with one
  underscore: a private module (``torch._prims_common``, ``torch.utils._pytree``,
  ``torch.fx._symbolic_trace``, ``torch.distributed._tools``), a private function or class
  (``torch._assert``, ``torch._C._set_grad_enabled``, ``torch.fx.graph_module._forward_from_src``)
  or a private attribute of a public module (``torch.nn.modules.module._global_forward_hooks``).
  Dunders (``torch.__version__``, ``torch.__file__``) are public.
* it counts however it is reached: ``import torch._x``, ``from torch._x import y``,
  ``from torch.x import _y``, and attribute reads rooted at a name bound by a torch import
  (``torch._C._foo``, ``fx._symbolic_trace``, ``nn.modules.module._global_forward_hooks``).
* strings, comments and docstrings do not count (they name things; they do not reach them).
* ``PUBLIC_BASES`` are the exceptions: torch's module base classes a library must subclass or
  ``isinstance``-check to recognise every BatchNorm / convolution / dropout a user writes.
  They carry an underscore but are torch's documented extension points, unchanged from 1.0
  to 2.15, and used the same way by torchvision and timm; routing them through ``_compat``
  would rename them, not protect anything.
* attributes of *instances* (``module._modules``, ``m._forward_hooks``) are not torch names:
  they are ``nn.Module``'s state, read by convbn where it copies or guards a module.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "convbn"
DOOR = SRC / "_compat.py"

#: Private-looking torch names allowed anywhere (see the module docstring).
PUBLIC_BASES = frozenset({
    "torch.nn.modules.batchnorm._BatchNorm",
    "torch.nn.modules.batchnorm._NormBase",
    "torch.nn.modules.conv._ConvNd",
    "torch.nn.modules.dropout._DropoutNd",
})


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    for base in PUBLIC_BASES:  # a public base's own attributes (``_BatchNorm.forward``) judged alone
        if dotted == base or dotted.startswith(base + "."):
            parts = dotted[len(base):].split(".")
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _dotted(node: ast.AST) -> Optional[Tuple[str, List[str]]]:
    """``(root name, [attr, ...])`` of an attribute chain ``a.b.c``; ``None`` for anything else."""
    attrs: List[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def private_uses(source: str) -> Iterator[Tuple[int, str]]:
    """``(line, private torch name)`` for every import or read of one in ``source``."""
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]
    bound: Dict[str, str] = {}  # local name -> the torch name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    if _private(alias.name):
                        yield node.lineno, alias.name
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch" or node.module.startswith("torch."):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if _private(name):
                        yield node.lineno, name
                    bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            chain = _dotted(node)
            if chain is not None and chain[0] in bound:
                name = ".".join([bound[chain[0]], *chain[1]])
                if _private(name):
                    yield node.lineno, name


def _files() -> List[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if p != DOOR]


def test_no_private_torch_name_outside_the_compat_module() -> None:
    found = [f"{p.relative_to(SRC.parents[1])}:{line}: {name}"
             for p in _files() for line, name in sorted(set(private_uses(p.read_text())))]
    assert not found, ("private torch names outside src/convbn/_compat.py (add an entry there, with the first "
                       "release that has it and a fallback, and import it from convbn._compat):\n" + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ("import torch._dynamo", ["torch._dynamo"]),
    ("import torch.fx._symbolic_trace as st", ["torch.fx._symbolic_trace"]),
    ("from torch._prims_common import suggest_memory_format", ["torch._prims_common.suggest_memory_format"]),
    ("from torch.utils import _pytree as pytree", ["torch.utils._pytree"]),
    ("from torch.fx.graph_module import _forward_from_src", ["torch.fx.graph_module._forward_from_src"]),
    ("import torch\ndef f():\n    return torch._C._set_grad_enabled(True)", ["torch._C._set_grad_enabled"]),
    ("import torch\nx = torch.utils._pytree.tree_leaves", ["torch.utils._pytree.tree_leaves"]),
    ("from torch.nn.modules import module as m\nm._global_forward_hooks", ["torch.nn.modules.module._global_forward_hooks"]),
    ("from torch import fx\nfx._symbolic_trace", ["torch.fx._symbolic_trace"]),
    ("from torch.nn.modules.batchnorm import _BatchNorm\n_BatchNorm.forward", []),
    ("from torch.nn.modules.batchnorm import _BatchNorm\n_BatchNorm._check_input_dim",
     ["torch.nn.modules.batchnorm._BatchNorm._check_input_dim"]),
    ("import torch\ntorch.__version__, torch.nn.Module.__call__", []),
    ("import torch\nm = torch.nn.Linear(2, 2)\nm._parameters", []),
    ("x = '''torch._C._foo'''  # torch._bar", []),
    ("import os\nos._exit", []),
])
def test_the_rule_finds_each_way_of_reaching_a_private_name(source: str, expected: List[str]) -> None:
    assert sorted({n for _, n in private_uses(source)}) == sorted(expected)


def test_the_compat_module_is_where_they_are() -> None:
    """The door itself holds private names (else this test would check nothing)."""
    assert len(set(private_uses(DOOR.read_text()))) >= 10
