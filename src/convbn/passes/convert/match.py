"""Matching: find Conv -> BatchNorm -> tail layers (and pre-activation heads and conv ends)
in a traced graph, and group them into chains.

Input: a ``torch.fx`` graph traced with :class:`~convbn.passes.tracing.trace.LayerTracer`
(convolutions with the standard forward, BatchNorms and convbn's own modules are leaves)
and its BatchNorm sites
(:mod:`convbn.passes.bn.sites`). Output: :class:`MatchedLayer` records (conv node and
geometry, BatchNorm node and module, the tail of element-wise ops found by
:mod:`convbn.passes.convert.match_tail`) and, for every BatchNorm that is not matched, a
 ``"left"`` outcome with the reason. :func:`group_chains` groups
consecutive matched layers into chains; the rewrite (:mod:`convbn.passes.convert.rewrite`)
replaces each chain by one fused module.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...functional.conv import conv_out_channels
from ..bn.kind import bn_conv_dims
from ..bn.sites import BNSite, find_bn_sites
from ..bn.norm_sites import find_norm_sites
from ...nn.norm_view import NormView
from .match_conv import MatchedConv, _match_conv, _zero_pad_of
from .match_tail import TailMatch, TailOpMatch, describe_node, match_tail, node_arg, tail_label
from ..report.convert_report import ConvertReport
from ..graph.grad_regions import grad_region_of
from ..graph.shape_uses import is_rank_use, value_users
from .shared_heads import split_shared_heads, split_shared_norm_heads
from .norm_linears import channels_last_norms_left
from ..bn.tokens import flattened_linear_reason

__all__ = ["MatchedConv", "MatchedLayer", "find_layers", "group_chains", "split_heads", "head_input", "node_arg",
           "describe_node"]



# --------------------------------------------------------------------------- matching


@dataclass
class MatchedLayer:
    """One fused layer found in the graph: ``[conv] -> [BN] -> tail``.

    Note: [matched layers and chains]
    Three kinds, as in :class:`convbn.nn.chain_layer.ChainLayer`:

    * ordinary: a conv whose output only the BN reads, the BN, and its tail;
    * *head* (``conv is None``): a BN whose input is not a fusable conv output but whose
      tail output only a conv reads (pre-activation: BN -> act -> conv). Its input, the
      chain input, is :attr:`input` (found in one place, :func:`head_input`);
    * *end* (``bn_node is None``): a conv reading only the previous layer's output with no
      BN after it; the chain ends at its output.

    :func:`group_chains` links a layer to the one whose output its conv reads; a head only
    starts a chain, an end only ends one, and a head that ends up alone is not fused.
    """

    conv: Optional[MatchedConv]
    bn_node: Optional[fx.Node]
    bn: Optional[_BatchNorm]
    bn_name: str
    tail: Tuple[TailOpMatch, ...] = ()
    shape_uses: Tuple[fx.Node, ...] = ()  # x.shape / x.ndim / x.size() of the conv, BN or inner tail outputs
    head_input: Optional[fx.Node] = None  # a head's chain input
    region: int = 0  # its grad-mode region (graph/grad_regions.py): a chain never crosses one

    @property
    def is_head(self) -> bool:
        return self.conv is None

    @property
    def is_end(self) -> bool:
        return self.bn_node is None

    @property
    def input(self) -> fx.Node:
        """The node the layer reads: its conv's input, or a head's chain input."""
        if self.conv is not None:
            return self.conv.input
        assert self.head_input is not None  # a head always has one (find_layers)
        return self.head_input

    @property
    def first(self) -> fx.Node:
        """The layer's first node in the graph (the chain call goes before it)."""
        return self.conv.node if self.conv is not None else self.bn_node  # type: ignore[return-value]

    @property
    def out(self) -> fx.Node:
        if self.tail:
            return self.tail[-1].node
        return self.bn_node if self.bn_node is not None else self.conv.node  # type: ignore[union-attr]

    @property
    def activation(self) -> str:
        """The tail as text (``relu``, ``dropout(0.1) -> prelu``, ``identity``)."""
        return tail_label(list(self.tail))

    def nodes(self) -> List[fx.Node]:
        """Every node the layer replaces, last first (the order to erase them in)."""
        found: List[fx.Node] = []
        for op in reversed(self.tail):
            found += [op.node, *op.extra]
        if self.bn_node is not None:
            found.append(self.bn_node)
        if self.conv is not None:
            found += [self.conv.node, *reversed(self.conv.absorbed)]
        return found


def head_input(site: BNSite) -> fx.Node:
    """The chain input of a pre-activation head starting at ``site``: the tensor its BN normalises.

    Note: [where a head's input is found]
    This is the one place that decides what a head reads: today the BN's input node,
    whatever computes it (a concatenation, an addition, a conv output others read too).
    A pass that gives a chain a structured input (the pieces of a channel concatenation,
    :mod:`convbn.passes.graph.concat_heads`) plugs in here; the rewrite passes :attr:`MatchedLayer.input`
    to the chain and nothing else assumes what it is.
    """
    return site.input


def _conv_bn_mismatch(conv: MatchedConv, bn: _BatchNorm) -> Optional[str]:
    """Why ``bn`` cannot normalise ``conv``'s output (rank or channels), or ``None``."""
    if isinstance(bn, NormView):  # a per-sample norm (functional/norms.py)
        if conv.spec.is_linear:
            return f"a {bn.row} after a linear layer (per-sample norms fuse after convolutions)"
        out = conv_out_channels(conv.weight_shape, conv.spec)
        if bn.channels and bn.channels != out:
            return f"the {bn.row} normalises {bn.channels} channels, but the convolution has {out} output channels"
        return None
    dims_ok = bn_conv_dims(bn)
    if dims_ok and conv.spec.dims not in dims_ok:
        what = "a linear layer" if conv.spec.is_linear else f"a {conv.spec.dims}-D convolution"
        return f"{type(bn).__name__} after {what}"
    if bn.num_features != conv_out_channels(conv.weight_shape, conv.spec):
        return "BatchNorm num_features does not match the convolution's output channels"
    return None


def _rank_mismatch(site: BNSite, conv: MatchedConv) -> Optional[str]:
    """Why ``site`` (a batch norm recognised only for some input ranks) cannot normalise
    tensors of ``conv``'s rank, or ``None``."""
    if site.ranks and conv.spec.dims + 2 not in site.ranks:
        return (f"{site.name} computes a batch norm only on {site.ranks}-D inputs, not on this "
                f"layer's {conv.spec.dims + 2}-D tensors")
    return None


def _conv_reading(out: fx.Node, gm: fx.GraphModule, root: nn.Module, prefix: str) -> Union[MatchedConv, str]:
    """The fusable convolution that is the only reader of ``out``'s values (directly, or
    through a zero padding it absorbs), with its qualified name; else why not."""
    users = value_users(out)
    if not users:
        return "nothing reads the value"
    if len(users) > 1:
        return "the value is read by " + ", ".join(describe_node(u) for u in users)
    user = cand = users[0]
    while _zero_pad_of(cand, gm) is not None and len(cand.users) == 1:  # the conv absorbs them (match_conv.py)
        cand = next(iter(cand.users))
    found = _match_conv(cand, gm, root)
    if found is None:
        return f"{describe_node(user)} reads the value, not a convolution"
    if isinstance(found, str):
        return found
    if found.input is not out:
        return f"{describe_node(cand)} reads the value, but not as the convolution's input"
    if found.spec.pre_pad_mode != "constant":
        return (f"the convolution {prefix}{found.name} pads its input with mode {found.spec.pre_pad_mode!r}, "
                "which only a chain's first convolution can do")
    found.name = prefix + found.name
    return found


def _match_head(site: BNSite, tail: TailMatch, gm: fx.GraphModule, root: nn.Module, prefix: str,
                chain: bool) -> Union[MatchedLayer, str]:
    """``site`` as a pre-activation head (BN -> tail -> conv), or why it is not one."""
    out = tail.out(site.node)
    after = f" after {tail_label(tail.ops)}," if tail.ops else ""
    conv = _conv_reading(out, gm, root, prefix)
    if isinstance(conv, str):
        short = "BN" if _norm_kind(site.bn) == "BatchNorm" else _norm_kind(site.bn)
        why = f"it does not start a pre-activation chain ({short} -> element-wise ops -> conv):{after} {conv}"
        if tail.blocked:
            why += f"; the element-wise ops stop at {tail.blocked}"
        return why
    if not chain:
        return (f"it starts a pre-activation BN -> {tail_label(tail.ops)} -> {conv.name}, which is fused only in "
                "chains; pass chain=True")
    dims_ok = bn_conv_dims(site.bn)
    if dims_ok and conv.spec.dims not in dims_ok:
        return f"{type(site.bn).__name__} before a {conv.spec.dims}-D convolution"
    wrong_rank = _rank_mismatch(site, conv)
    if wrong_rank is not None:
        return wrong_rank
    return MatchedLayer(None, site.node, site.bn, site.name, tuple(tail.ops), tuple(tail.shape_uses), head_input(site))


def _conv_before_tail(src: Any, gm: fx.GraphModule, root: nn.Module, prefix: str) -> Optional[str]:
    """``"<tail> of convolution <name>"`` if ``src`` ends the element-wise tail of a conv
    output (conv -> act -> BN), else ``None``."""
    node = src
    while isinstance(node, fx.Node) and node.op in ("call_module", "call_function", "call_method") and node.args:
        node = node.args[0]
        conv = _match_conv(node, gm, root) if isinstance(node, fx.Node) else None
        if isinstance(conv, MatchedConv):
            tail = match_tail(node, root, prefix)
            return f"{tail_label(tail.ops)} of convolution {prefix}{conv.name}" if tail.ops and tail.out(node) is src else None
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
    return None


def split_heads(gm: fx.GraphModule, root: nn.Module, prefix: str) -> List[str]:
    """:func:`~convbn.passes.convert.shared_heads.split_shared_heads` where a head would join
    the conv that reads it as matching sees it: ``act(bn(x))`` read by several convs -> one head each."""
    joins = lambda conv, out, bn: _head_conv_joins(conv, out, bn, gm, root)  # noqa: E731
    return split_shared_heads(gm, root, prefix, joins) + split_shared_norm_heads(gm, root, prefix, joins)


def _head_conv_joins(node: fx.Node, out: fx.Node, bn: nn.Module, gm: fx.GraphModule, root: nn.Module) -> bool:
    """Whether conv ``node``, reading the output ``out`` of a head with BatchNorm ``bn`` alone,
    would be matched after the head and join its chain (:func:`_match_head`, :func:`group_chains`)."""
    found = _match_conv(node, gm, root)
    dims_ok = bn_conv_dims(bn)
    return (isinstance(found, MatchedConv) and found.input is out and found.spec.pre_pad_mode == "constant"
            and not found.absorbed and (not dims_ok or found.spec.dims in dims_ok))


def _end_layers(layers: List[MatchedLayer], gm: fx.GraphModule, root: nn.Module, prefix: str) -> List[MatchedLayer]:
    """End layers: a convolution with no BN after it that is the only reader of a layer's output.

    Note: [conv -> act layers inside a per-sample chain]
    After a per-sample norm layer (functional/norms.py) an end takes the element-wise tail after
    its convolution too, and a convolution reading that tail's output is an end in turn: a
    ConvNeXt block's ``dwconv -> LayerNorm -> 1x1 conv -> GELU -> 1x1 conv`` is one chain, the
    middle layer a convolution with an activation and no norm. BatchNorm chains end at their
    first end layer, as before.
    """
    claimed = {l.conv.node for l in layers if l.conv is not None}
    ends: List[MatchedLayer] = []
    per_sample = {id(l) for l in layers if isinstance(l.bn, NormView)}
    todo = list(layers)
    while todo:
        l = todo.pop(0)
        conv = _conv_reading(l.out, gm, root, prefix)
        if not isinstance(conv, MatchedConv) or conv.node in claimed:
            continue
        claimed.add(conv.node)
        end = MatchedLayer(conv, None, None, "")
        if id(l) in per_sample and not conv.spec.is_linear and len(conv.node.users) == 1:
            tail = match_tail(conv.node, root, prefix)
            if tail.ops and not tail.shape_uses:
                end = dataclasses.replace(end, tail=tuple(tail.ops))
                per_sample.add(id(end))
                todo.append(end)
        ends.append(end)
    return ends


def _all_sites(gm: fx.GraphModule, root: nn.Module, prefix: str, report: ConvertReport, chain: bool) -> List[BNSite]:
    """BatchNorm and per-sample norm sites (functional/norms.py) in graph order; each norm that
    cannot be a site is reported left in ``report``, one line per norm (a LayerNorm over the
    channels of a channels-last map too: Note: [a channels-last LayerNorm before a Linear])."""
    found = find_bn_sites(gm, prefix, root)
    norms = find_norm_sites(gm, prefix, root)
    for bn_name, bn_why in found.left + norms.left + channels_last_norms_left(gm, root, prefix, chain):
        if not any(o.batchnorm == bn_name for o in report.recorded):  # one line per BatchNorm
            report.leave(bn_name, bn_why)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found.sites + norms.sites, key=lambda s: order[s.node])


def find_layers(gm: fx.GraphModule, root: nn.Module, prefix: str, report: ConvertReport,
                chain: bool = True) -> List[MatchedLayer]:
    """Every fusable layer of ``gm`` in graph order; each BatchNorm not matched is reported
    left in ``report``, with the reason.

    Args:
        gm: the traced graph module.
        root: the user's module it was traced from (weights and tail modules are looked up on it).
        prefix: ``root``'s qualified name + ``"."`` (``""`` for the model itself), for reports.
        report: receives the skipped BatchNorms.
        chain: whether chains will be built; without them there are no heads and no ends
            (a pre-activation layer only pays inside a chain).

    Returns:
        Ordinary layers, heads and end layers (Note: [matched layers and chains]), in graph order.

    ``gm`` is read as the pipeline's canonicalising rewrites left it
    (``convbn.passes.convert.pipeline.CANONICALISE``); matching changes no node.
    """
    layers: List[MatchedLayer] = []
    for site in _all_sites(gm, root, prefix, report, chain):
        node, bn, name, src = site.node, site.bn, site.name, site.input
        tail = match_tail(node, root, prefix)
        conv = _match_conv(src, gm, root)
        conv_name: Optional[str] = None
        if conv is None:
            why: Optional[str] = (flattened_linear_reason(node, gm)
                                  or f"its input is not a convolution output (it follows {describe_node(src)})")
            after_act = _conv_before_tail(src, gm, root, prefix)
            if after_act is not None:
                what = _norm_kind(bn)
                short = "BN" if what == "BatchNorm" else what
                why = (f"{what} after an activation: it follows {after_act} (conv -> activation -> {short} order); "
                       f"a chain layer computes conv -> {short} -> activation, and the activation between the "
                       f"convolution and this {short} keeps it out of the convolution's layer (it fuses as a chain "
                       "head where a convolution alone reads it, after element-wise ops only)")
        elif isinstance(conv, str):
            why = conv
        else:
            conv.name = conv_name = prefix + conv.name
            others = [u for u in value_users(src) if u is not node]
            why = (f"the convolution's output is also used by {', '.join(describe_node(u) for u in others)}"
                   if others else _conv_bn_mismatch(conv, bn) or _rank_mismatch(site, conv))
        if why is None:
            assert isinstance(conv, MatchedConv)
            shape_uses = tuple(u for u in src.users if u is not node) + tuple(tail.shape_uses)
            layers.append(MatchedLayer(conv, node, bn, name, tuple(tail.ops), shape_uses))
            continue
        head = _match_head(site, tail, gm, root, prefix, chain)
        if isinstance(head, MatchedLayer):
            layers.append(head)
        else:
            report.leave(name, f"{why}; {head}", conv_name)
    if chain:
        layers += _end_layers(layers, gm, root, prefix)
    layers = _within_grad_regions(layers, grad_region_of(gm.graph), report)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(layers, key=lambda l: index[l.first])


def _within_grad_regions(layers: List[MatchedLayer], regions: Dict[fx.Node, int], report: ConvertReport
                         ) -> List[MatchedLayer]:
    """Layers that stay inside one grad-mode region (``with torch.no_grad():`` and the like,
    recorded by the trace): a tail op past the border is cut off (it runs as traced, in its
    own mode); a layer whose conv and BatchNorm lie in different regions is left, reported."""
    if not regions:
        return layers
    kept: List[MatchedLayer] = []
    for l in layers:
        region = regions[l.bn_node if l.bn_node is not None else l.first]
        tail = l.tail
        while tail and any(regions[n] != region for n in (tail[-1].node, *tail[-1].extra)):
            tail = tail[:-1]
        l = dataclasses.replace(l, tail=tail, region=region)
        if any(regions[n] != region for n in l.nodes()):
            if l.bn_node is not None:
                report.leave(l.bn_name, "its convolution and the BatchNorm run in different grad modes (a "
                             "torch.no_grad() / enable_grad() / inference_mode() border lies between them)",
                             l.conv.name if l.conv is not None else None)
            continue
        kept.append(l)
    return kept


def _norm_kind(bn: object) -> str:
    """What the reports call a norm: ``BatchNorm``, or a per-sample norm's class (``InstanceNorm3d``)."""
    return type(bn.owner).__name__ if isinstance(bn, NormView) else "BatchNorm"


def _per_sample(l: MatchedLayer, prev: Optional[MatchedLayer] = None) -> bool:
    """Whether ``l`` belongs in a per-sample norm chain: its norm is one; an end layer with a
    tail is (only those chains have them); another end layer goes with the layer it follows."""
    if l.bn is None:
        return bool(l.tail) or (prev is not None and _per_sample(prev))
    return isinstance(l.bn, NormView)


def _computes_weight(chain: List[MatchedLayer]) -> bool:
    """Whether a layer of ``chain`` computes its convolution's weight (Note: [one computed weight per chain]).

    Note: [one computed weight per chain]
    A chain's Function returns every weight's gradient when its backward ends. For a stored
    weight that gradient is the parameter's ``.grad``, which eager holds too. For a weight the
    model computes (``StdConv2d``) it is a temporary, handed on to the model's weight computation
    only then: a chain of k such layers holds k weight-sized gradients at once where eager holds
    one, and on weight-heavy steps (BiT ResNets at small batches) the fused step peaked above
    eager's (234.1 MB against 232.0 MB, resnetv2_50x1_bit in float64 at batch 2, 64 x 64) and
    every chain ran eager. So a chain takes at most one layer with a computed weight: the next
    one starts a chain of its own (an end layer with one is left to the graph). The price, where
    activations dominate: resnetv2_50x1_bit at batch 8, 128 x 128 peaks at 0.72x of eager's with
    this rule, 0.63x without it (BENCHMARKS.md, ``bm_norm_nets.py --nets bit --several-computed``).
    """
    return any(m.conv is not None and m.conv.computed is not None for m in chain)


def group_chains(layers: List[MatchedLayer], chain: bool, report: Optional[ConvertReport] = None
                 ) -> List[List[MatchedLayer]]:
    """Group layers (in graph order) into chains: a layer joins the chain whose last layer's
    output its conv alone reads. Heads only start chains, ends only end them; an end that
    joins nothing is dropped, and a head left alone is reported in ``report`` and dropped."""
    by_out = {l.out: l for l in layers if not l.is_end or l.tail}  # Note: [conv -> act layers inside a per-sample chain]
    chains: List[List[MatchedLayer]] = []
    where: Dict[int, List[MatchedLayer]] = {}
    for l in layers:  # graph (topological) order
        prev = None if l.is_head else by_out.get(l.input)
        # a layer whose inner tensors' shapes are read must end its chain: only the
        # chain's output exists to read them from (see Note: [shape-only uses] in shape_uses.py);
        # rank reads (x.ndim, as norm-act layers check) are the same on every tensor of a chain
        if (chain and prev is not None and id(prev) in where and where[id(prev)][-1] is prev
                and len(prev.out.users) == 1 and all(is_rank_use(u) for u in prev.shape_uses)
                and prev.region == l.region and _per_sample(prev) == _per_sample(l, prev)
                and l.conv is not None and l.conv.spec.pre_pad_mode == "constant"
                and not (l.conv.computed is not None and _computes_weight(where[id(prev)]))):
            c = where[id(prev)]
        elif l.is_end:
            continue
        else:
            c = []
            chains.append(c)
        c.append(l)
        where[id(l)] = c
    kept = []
    for c in chains:
        if len(c) == 1 and c[0].is_head:
            if report is not None:
                report.leave(c[0].bn_name, _lone_head_reason(c[0], layers))
            continue
        kept.append(c)
    return kept


def _lone_head_reason(head: MatchedLayer, layers: List[MatchedLayer]) -> str:
    """Why a pre-activation head starts no chain: the layer after it reads its output but did not
    join; where that layer's norm is of the other family (a chain holds BatchNorms or per-sample
    norms, one Function each), the reason says so."""
    short = "BN" if _norm_kind(head.bn) == "BatchNorm" else _norm_kind(head.bn)
    start = f"it would start a pre-activation chain ({short} -> {head.activation} -> conv), but the convolution after it"
    after = next((l for l in layers if l.input is head.out and not l.is_head and l.bn is not None), None)
    if after is not None and _per_sample(after) != _per_sample(head):
        return (f"{start} is normalised by a {_norm_kind(after.bn)} ('{after.bn_name}'): a chain holds BatchNorms or "
                f"per-sample norms, not both; {short} -> act alone saves nothing")
    values = value_users(head.out)
    read = [u for u in head.out.users if u not in values and not is_rank_use(u)]
    if read:  # the head found its conv as the value's one reader: the others read its shape (Note: [shape-only uses])
        what = f"'.{read[0].args[1]}'" if read[0].target is getattr else describe_node(read[0])
        return (f"{start} cannot join it: the model reads the shape of the value between them ({what}), "
                f"which inside a chain exists only as the chain's output; {short} -> act alone saves nothing")
    return f"{start} cannot join the chain (see that layer's line); {short} -> act alone saves nothing"
