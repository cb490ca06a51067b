"""How fold gives a layer its folded weights inside a traced graph: overwrite them where
the layer is the graph's alone (``inplace``) or swap in a copy holding them, and point a
call shared with other code at a fresh copy; then drop the BatchNorm node. Graph surgery
only: the folded tensors come from :mod:`convbn.functional.fold`."""
from __future__ import annotations

from typing import Dict

import torch.fx as fx
from torch import Tensor, nn

from .layers import clone_with, free_name, get_attr_value, owner_path
from .match import FoldLayer, FoldSite, qualified

__all__ = ["WeightInstaller"]


class WeightInstaller:
    """Installs folded weights into the layers of one traced GraphModule ``gm`` (traced at
    ``prefix``); ``inplace`` overwrites parameters the graph holds alone."""

    def __init__(self, gm: fx.GraphModule, prefix: str, inplace: bool) -> None:
        self.gm = gm
        self.prefix = prefix
        self.inplace = inplace
        self.modules: Dict[str, nn.Module] = dict(gm.named_modules())
        self.changed = False

    # -- sharing ------------------------------------------------------------------
    def _module_exclusive(self, target: str) -> bool:
        """Module ``target`` is used by exactly one graph node and reachable by one name."""
        calls = 0
        for n in self.gm.graph.nodes:
            if n.op == "call_module":
                if n.target == target:
                    calls += 1
                elif target.startswith(n.target + "."):
                    return False  # used inside an opaque module too
            elif n.op == "get_attr" and n.target.startswith(target + "."):
                return False
        if calls != 1:
            return False
        mod = self.modules[target]
        return sum(1 for _, m in self.gm.named_modules(remove_duplicate=False) if m is mod) == 1

    def _attr_exclusive(self, attr_node: fx.Node, user: fx.Node) -> bool:
        target = attr_node.target
        if set(attr_node.users) != {user}:
            return False
        owner = owner_path(target)
        for n in self.gm.graph.nodes:
            if n is attr_node:
                continue
            if n.op == "get_attr" and n.target == target:
                return False
            if n.op == "call_module" and (owner == n.target or owner.startswith(n.target + ".")):
                return False
        value = get_attr_value(self.gm, target)
        return sum(1 for _, p in self.gm.named_parameters(remove_duplicate=False) if p is value) <= 1

    @staticmethod
    def _tied(module: nn.Module, root: nn.Module) -> bool:
        ids = {id(p) for p in module.parameters(recurse=False)}
        count = sum(1 for _, p in root.named_parameters(remove_duplicate=False) if id(p) in ids)
        return count != len(ids)

    # -- rewriting ----------------------------------------------------------------
    def install(self, layer: FoldLayer, weight: Tensor, bias: Tensor) -> str:
        """Make ``layer.node`` compute with ``weight``/``bias``; returns a note."""
        if layer.module is not None:
            return self._install_module(layer, weight, bias)
        return self._install_functional(layer, weight, bias)

    def _install_module(self, layer: FoldLayer, weight: Tensor, bias: Tensor) -> str:
        """``install`` for a layer module: overwritten, swapped for a copy, or a fresh copy for this call."""
        target = layer.node.target
        if self._module_exclusive(target):
            if self.inplace and not self._tied(layer.module, self.gm):
                # inplace=True: overwrite the existing parameters (saves memory).
                layer.module.weight.data = weight.detach().to(layer.module.weight.dtype)
                if layer.module.bias is None:
                    layer.module.bias = nn.Parameter(bias.detach(), requires_grad=layer.weight.requires_grad)
                else:
                    layer.module.bias.data = bias.detach().to(layer.module.bias.dtype)
                return ""
            new = clone_with(layer.module, weight, bias)
            parent, _, attr = target.rpartition(".")
            setattr(self.gm.get_submodule(parent), attr, new)
            self.modules[target] = new
            return ""
        new_target = free_name(self.gm, target + "_bnfold")
        new = clone_with(layer.module, weight, bias)
        self.gm.add_submodule(new_target, new)
        self.modules[new_target] = new
        layer.node.target = new_target
        return f"fresh copy '{qualified(self.prefix, new_target)}': the layer is also used elsewhere"

    def _install_functional(self, layer: FoldLayer, weight: Tensor, bias: Tensor) -> str:
        """``install`` for a functional layer: point the call at new parameters."""
        requires_grad = layer.weight.requires_grad
        args = dict(layer.args)
        w_node, b_node = args["weight"], args["bias"]
        notes = []
        w_excl = self._attr_exclusive(w_node, layer.node)
        if w_excl:
            self._replace_attr(w_node.target, weight, requires_grad)
            new_w = w_node
        else:
            new_w = self._new_param_node(w_node.target, weight, requires_grad, layer.node)
            notes.append(f"new weight '{qualified(self.prefix, new_w.target)}' (the original is shared)")
        owner = owner_path(w_node.target)
        if b_node is not None and self._attr_exclusive(b_node, layer.node):
            self._replace_attr(b_node.target, bias, requires_grad)
            new_b = b_node
        elif b_node is None and w_excl and not hasattr(self.gm.get_submodule(owner), "bias"):
            self.gm.get_submodule(owner).register_parameter(
                "bias", nn.Parameter(bias.detach().clone(), requires_grad=requires_grad))
            with self.gm.graph.inserting_before(layer.node):
                new_b = self.gm.graph.get_attr(f"{owner}.bias" if owner else "bias")
        else:
            base = b_node.target if b_node is not None else (f"{owner}.bias" if owner else "bias")
            new_b = self._new_param_node(base, bias, requires_grad, layer.node)
        args["weight"], args["bias"] = new_w, new_b
        layer.node.args = tuple(args[n] for n, _ in layer.call.sig)
        layer.node.kwargs = {}
        for old in (w_node, b_node):
            if isinstance(old, fx.Node) and not old.users and not old._erased:
                self.gm.graph.erase_node(old)
        return "; ".join(notes)

    def _replace_attr(self, target: str, value: Tensor, requires_grad: bool) -> None:
        current = get_attr_value(self.gm, target)
        if self.inplace and isinstance(current, nn.Parameter):
            current.data = value.detach().to(current.dtype)  # inplace=True: overwrite
            return
        owner, _, attr = target.rpartition(".")
        setattr(self.gm.get_submodule(owner), attr, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))

    def _new_param_node(self, base: str, value: Tensor, requires_grad: bool, before: fx.Node) -> fx.Node:
        name = free_name(self.gm, base.replace(".", "_") + "_bnfold")
        self.gm.register_parameter(name, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(name)

    def remove_bn(self, site: FoldSite, replacement: fx.Node) -> None:
        """Drop ``site``'s node (its users read ``replacement``) and the attributes only it read."""
        site.node.replace_all_uses_with(replacement)
        self.gm.graph.erase_node(site.node)
        for n in site.attr_nodes:
            if not n.users and not n._erased:
                self.gm.graph.erase_node(n)
        self.changed = True
