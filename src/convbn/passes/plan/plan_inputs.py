"""What the peak planner reads, measured on a converted model at one batch, and the same
predicted at another batch from two measurements.

:func:`measure_plan_inputs` measures a converted model's chains (shapes, MACs, saved
bytes, one recorded step) into :class:`PlanInputs`; :meth:`PlanInputs.costs` and
:meth:`PlanInputs.gaps` are the planner's :class:`~convbn.passes.plan.peak_model.ChainCost`\\ s
and moments outside the chains. :func:`plan_inputs_at` predicts them at any batch.

# Note: [planner inputs are affine in the batch]
# Every tensor a training step makes is batch-sized (activations and their gradients:
# bytes proportional to the batch) or not (parameter gradients, statistics, optimizer
# temporaries), so for a fixed model and plan the live bytes after each operator are
# affine in the batch, as long as the step runs the same operators. Every number the
# planner reads is such a byte count (conv outputs and inputs, saved bytes, MACs) or the
# most of them over a part of the step (a chain's prefix, the moments between chains).
# :class:`PlanInputs` keeps the recorded points and which part each belongs to; recorded at
# two batches running the same operators, each point is a line, and the maxima at a third
# batch are taken over the lines: exactly the measured ones where the step is affine.
# :func:`plan_inputs_at` refuses two records whose operators or parts differ.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from ..._compat import pytree

from ...functional.conv import recompute_cost
from ...functional.norms import stat_bytes
from ...memory import timeline, track_saved
from ...nn.chain import ChainLayer, FusedChain
from ...nn.norm_view import NormView
from ..check.validate import StateSnapshot
from ..graph.graph_module import fused_modules
from .chain_plans import recompute_all
from .peak_model import ChainCost, chain_backward_peak
from .planner import all_keep_bytes

__all__ = ["PlanInputs", "measure_plan_inputs", "plan_inputs_at", "measure_peak", "trained_outputs_loss", "chains_of"]

Ints = Tuple[int, ...]


@dataclass(frozen=True)
class PlanInputs:
    """The planner's inputs for one converted model at one batch, as plain numbers.

    Attributes:
        batch: the batch they were measured at (or predicted for).
        y_bytes / x_bytes / flops / w_bytes / s_bytes / acts: per chain (forward order), per
            layer: conv output and input bytes, conv MACs, parameter-gradient bytes,
            BatchNorm statistics bytes, activation kind (:class:`ChainCost`).
        head / end / norms: per chain, as in :class:`ChainCost`.
        prefix_est: per chain, the prefix estimated from saved bytes (where the recorded
            step cannot tell its backward apart).
        floor: saved activation bytes with every layer keeping nothing.
        extra: bytes every layer keeping its conv output would add (``all_keep_bytes``).
        points: live bytes after each operator of one recorded step (every layer keeping nothing).
        slots: for each point, the chain whose backward runs (``j >= 0``), or ``-(m + 1)``:
            a moment outside the chains' backwards where the first ``m`` chains may hold kept outputs.
        ops: for each point, its phase and operator (two records must agree on them).
        inner: for each point inside a per-sample-norm chain's forward, the layer running
            (its chain is the one ``slots`` says ran last); -1 elsewhere (Note: [a moment
            inside a chain's forward] in peak_model.py).
        drops: per chain, per layer, the ``may_drop`` flags the recorded step ran with: a
            per-sample-norm chain's backward depends on them (Note: [a norm before a dropped conv
            recomputed once] in autograd/norm_chain.py), so its prefix is its peak less the
            transient replayed with them; empty: every layer may drop.
    """

    batch: int
    y_bytes: Tuple[Ints, ...]
    x_bytes: Tuple[Ints, ...]
    flops: Tuple[Ints, ...]
    w_bytes: Tuple[Ints, ...]
    s_bytes: Tuple[Ints, ...]
    acts: Tuple[Tuple[str, ...], ...]
    head: Tuple[bool, ...]
    end: Tuple[bool, ...]
    norms: Tuple[Tuple[str, ...], ...]
    prefix_est: Ints
    floor: int
    extra: int
    points: Ints
    slots: Ints
    ops: Tuple[str, ...]
    inner: Ints = ()
    drops: Tuple[Tuple[bool, ...], ...] = ()

    def costs(self) -> List[ChainCost]:
        """The chains' :class:`ChainCost` in forward order, each prefix measured where the
        recorded step shows the chain's backward: its peak there less the replayed transient."""
        peaks: Dict[int, int] = {}
        for b, s in zip(self.points, self.slots):
            if s >= 0:
                peaks[s] = max(peaks.get(s, 0), b)
        forward = self._forward_moments()
        out = []
        for j in range(len(self.y_bytes)):
            cost = ChainCost(
                y_bytes=self.y_bytes[j], x_bytes=self.x_bytes[j],
                macs=tuple(recompute_cost(f, x, y) for f, x, y in zip(self.flops[j], self.x_bytes[j], self.y_bytes[j])),
                acts=self.acts[j], prefix=self.prefix_est[j], w_bytes=self.w_bytes[j], head=self.head[j],
                end=self.end[j], s_bytes=self.s_bytes[j], norms=self.norms[j],
                forward=forward[j] if self.norms[j] and any(forward[j]) else ())
            if j in peaks:
                drops = self.drops[j] if self.drops and self.norms[j] else True
                own = chain_backward_peak(cost, [False] * len(cost.y_bytes), drops)[0]
                cost = replace(cost, prefix=max(0, peaks[j] - own))
            out.append(cost)
        return out

    def _forward_moments(self) -> List[Tuple[int, ...]]:
        """Per chain, per layer: the most bytes in use inside the chain's forward while the
        layer ran (Note: [a moment inside a chain's forward] in peak_model.py)."""
        forward = [[0] * len(y) for y in self.y_bytes]
        for b, s, i in zip(self.points, self.slots, self.inner or ()):
            if i >= 0:  # inside chain -s - 2's forward, at its layer i
                forward[-s - 2][i] = max(forward[-s - 2][i], b)
        return [tuple(f) for f in forward]

    def gaps(self) -> List[int]:
        """``gaps[m]``: the most bytes in use at a moment outside every chain's backward while
        the first ``m`` chains may hold kept outputs (Note: [moments outside the chains])."""
        out = [0] * (len(self.y_bytes) + 1)
        inner = self.inner or (-1,) * len(self.points)
        for b, s, i in zip(self.points, self.slots, inner):
            if s < 0 and i < 0:  # a moment inside a norm chain's forward is that chain's (costs())
                out[-s - 1] = max(out[-s - 1], b)
        return out


def chains_of(model: nn.Module) -> List[FusedChain]:
    """The chains a rewrite added to ``model`` (registered or not)."""
    return [m for _, m in fused_modules(model) if isinstance(m, FusedChain)]


def _names(model: nn.Module) -> Dict[int, str]:
    """Qualified names of ``model``'s modules and of the fused modules a rewrite added."""
    names = {id(m): n for n, m in model.named_modules()}
    names.update({id(m): n for n, m in fused_modules(model)})
    return names


def measure_plan_inputs(converted: nn.Module, inputs: Tuple[Any, ...], *,
                        optimizer: Optional[torch.optim.Optimizer] = None,
                        loss_fn: Optional[Callable[[Any], Tensor]] = None) -> Tuple[List[FusedChain], PlanInputs]:
    """The chains of ``converted`` in forward order and what the planner reads of them,
    measured with every layer keeping nothing (the layers are left so; their modes are the
    caller's to set).

    A chain's ``prefix`` is what is alive besides it when its backward runs: activations
    saved before it, the gradients of the parameters used after it (their backward has
    run by then, and with ``zero_grad(set_to_none=True)`` they did not exist at the end of
    forward), and whatever autograd holds for the ops around it (a residual branch's
    gradient, an output another op saved). It is measured: one recorded step of this
    all-recompute plan gives each chain's peak, less its replayed transient. Where a
    chain's backward cannot be told apart in the recording, it is estimated from the
    saved bytes: activations saved before it plus the gradients of the parameters used
    after it. The recorded step has no optimizer and the mean output as its loss, as
    ``convert`` plans; ``optimizer`` / ``loss_fn`` record another step (the moments of
    the optimizer step then count as moments outside the chains).
    """
    for m in chains_of(converted):
        m.apply_plan(recompute_all(m))
    converted.train()
    # one recorded step gives the saves of its forward too (Note: [the saves read off the recorded step])
    run = _recorded_step(converted, inputs, chains_of(converted), optimizer, loss_fn)
    rec = run.saved
    names = _names(converted)
    chain_params = {names[id(m)]: _chain_param_bytes(m) for m in chains_of(converted)}
    # walk the saves in forward order: a chain's prefix = activations saved before it +
    # gradients of every parameter used after it (saved ones, and later chains' own)
    first: Dict[str, Tuple[int, int]] = {}
    order: Dict[str, int] = {}
    acts_before, params_before = 0, 0
    for (mod, _, _, nbytes), is_param in zip(rec.shapes, rec.is_param):
        if mod not in first:
            first[mod], order[mod] = (acts_before, params_before), len(order)
            params_before += chain_params.get(mod, 0)
        if is_param:
            params_before += nbytes
        else:
            acts_before += nbytes
    total_params = params_before
    prefix = {m: a + total_params - p - chain_params.get(m, 0) for m, (a, p) in first.items()}
    chains = [m for m in chains_of(converted) if names.get(id(m)) in first]
    chains.sort(key=lambda m: order[names[id(m)]])  # forward order
    points, slots, ops, inner = _slots(converted, run, chains)
    batch = next((int(t.shape[0]) for t in inputs if isinstance(t, Tensor) and t.dim() > 0), 0)
    per_layer = lambda f: tuple(tuple(f(l) for l in c.layers) for c in chains)  # noqa: E731
    return chains, PlanInputs(
        batch=batch, y_bytes=per_layer(ChainLayer.y_bytes), x_bytes=per_layer(ChainLayer.x_bytes),
        flops=per_layer(ChainLayer.flops), w_bytes=per_layer(_layer_param_bytes), s_bytes=per_layer(_stat_bytes),
        acts=per_layer(ChainLayer.tail_kind), head=tuple(c.layers[0].is_head for c in chains),
        end=tuple(c.layers[-1].is_end for c in chains), norms=tuple(_norms(c) for c in chains), prefix_est=tuple(prefix[names[id(c)]] for c in chains),
        floor=rec.activation_bytes, extra=all_keep_bytes([m.layers for m in chains_of(converted)]),
        points=points, slots=slots, ops=ops, inner=inner, drops=tuple(tuple(c.plan.may_drop) for c in chains))


# Note: [the saves read off the recorded step]
# The planner reads two things of the converted model's all-recompute step: what its forward
# saves for backward, module by module (``track_saved``), and the bytes alive after every
# operator of the whole step (``timeline``). They were two runs, a forward and then a step;
# now the saves are counted during the recorded step's forward and the counting stops as the
# loss is taken (the loss's own saves were never counted, and a chain's backward recomputing
# its convolutions saves again, which is not what its forward keeps). Counting returns each
# saved tensor as a detached alias of the same storage, so the bytes the timeline sees are
# the same.


@dataclass
class _Run:
    """One recorded step: its timeline, the autograd node of each chain's output (by id, to the
    index of the chain in ``chains``, the nodes kept alive until read) and its forward's saves."""

    tl: Any
    nodes: Dict[int, FusedChain]
    held: List[Any]
    saved: Any


def _recorded_step(converted: nn.Module, inputs: Tuple[Any, ...], chains: Sequence[FusedChain],
                   optimizer: Optional[torch.optim.Optimizer], loss_fn: Optional[Callable[[Any], Tensor]]) -> _Run:
    """Run one recorded step (Note: [the saves read off the recorded step])."""
    nodes: Dict[int, FusedChain] = {}
    held: List[Any] = []  # the nodes stay alive (their ids unique) until the step is read

    def record(c: FusedChain) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, Tensor) and out.grad_fn is not None:
                nodes[id(out.grad_fn)] = c
                held.append(out.grad_fn)
        return hook

    counting = track_saved(converted, per_module=True)

    def loss(out: Any) -> Tensor:
        counting.__exit__(None, None, None)  # the forward is over
        return (loss_fn or trained_outputs_loss)(out)

    handles = [c.register_forward_hook(record(c)) for c in chains]
    try:
        with torch.enable_grad(), counting:
            # a chain's backward is told by its autograd node (Note: [a module tracker for the forward only])
            tl = measure_peak(converted, inputs, optimizer=optimizer, loss_fn=loss, backward_modules=False)
    finally:
        for h in handles:
            h.remove()
    return _Run(tl, nodes, held, counting.result)


def _slots(converted: nn.Module, run: _Run, chains: Sequence[FusedChain]) -> Tuple[Ints, Ints, Tuple[str, ...], Ints]:
    """Each point's bytes, slot and layer inside a norm chain's forward (:class:`PlanInputs`),
    ``chains`` in forward order. A chain's backward is found by its autograd node (its output's
    ``grad_fn``), its forward by the module running; the other moments (Note: [moments outside
    the chains] in peak_model.py) by the chains whose forward has started and whose backward has not."""
    index = {id(c): j for j, c in enumerate(chains)}
    nodes = {n: index[id(c)] for n, c in run.nodes.items() if id(c) in index}
    tl = run.tl
    names = _names(converted)
    chain_of = {names[id(c)]: j for j, c in enumerate(chains) if id(c) in names}
    layer = _ForwardLayer(chains)
    ran = -1  # the last chain (forward order) whose forward has started
    done = set()  # chains whose backward has started
    slots, inner = [], []
    for pt in tl.points:
        j = nodes.get(pt.node) if pt.node else None
        if j is not None:
            done.add(j)
            slots.append(j)
            inner.append(-1)
            continue
        owner = None
        if pt.phase == "backward":
            alive = max((i for i in range(len(chains)) if i not in done), default=-1)
        else:
            owner = chain_of.get(pt.module.split(".")[0]) if pt.module else None
            if owner is None:  # a chain nested in a submodule: match by its dotted name
                owner = next((i for n, i in chain_of.items() if pt.module == n or pt.module.startswith(n + ".")), None)
            if owner is not None:
                ran = max(ran, owner)
            alive = ran if pt.phase in ("forward", "loss") else -1
        slots.append(-(alive + 2))
        inner.append(layer.at(owner, pt.op) if pt.phase == "forward" and owner == alive else -1)
    return (tuple(p.bytes for p in tl.points), tuple(slots),
            tuple(f"{p.phase}:{p.op.rpartition('/')[2]}" for p in tl.points), tuple(inner))


class _ForwardLayer:
    """The layer of a per-sample-norm chain whose forward an operator belongs to: a layer
    starts at its convolution (a pre-activation head, layer 0, has none); -1 outside such a
    chain (Note: [a moment inside a chain's forward] in peak_model.py)."""

    def __init__(self, chains: Sequence[FusedChain]) -> None:
        self.norm = [bool(_norms(c)) for c in chains]
        self.head = [c.layers[0].is_head for c in chains]
        self.size = [len(c.layers) for c in chains]
        self.owner: Optional[int] = None
        self.convs = 0

    def at(self, owner: Optional[int], op: str) -> int:
        if owner is None or not self.norm[owner]:
            self.owner = None
            return -1
        if owner != self.owner:
            self.owner, self.convs = owner, 0
        if op.rpartition("/")[2].startswith("aten.convolution"):
            self.convs += 1
        return min(max(self.convs - 1 + self.head[owner], 0), self.size[owner] - 1)


def _line(a: int, b: int, ba: int, bb: int, batch: int) -> int:
    """The value at ``batch`` of the line through ``(ba, a)`` and ``(bb, b)``, rounded."""
    return round(a + Fraction(b - a, bb - ba) * (batch - ba))


_CONSTANT = ("w_bytes", "s_bytes", "acts", "head", "end", "norms", "slots", "ops", "inner", "drops")


def plan_inputs_at(a: PlanInputs, b: PlanInputs, batch: int) -> PlanInputs:
    """:class:`PlanInputs` at ``batch``, each number on the line through its values in ``a``
    and ``b`` (Note: [planner inputs are affine in the batch]).

    Raises:
        ValueError: ``a`` and ``b`` were measured at the same batch, or their steps differ
            in structure (chains, layers, operators, parts): they do not define lines.
    """
    if a.batch == b.batch:
        raise ValueError(f"plan_inputs_at needs two different batches, but got {a.batch} twice")
    for name in _CONSTANT:
        if getattr(a, name) != getattr(b, name):
            raise ValueError(f"the steps at batch {a.batch} and {b.batch} differ in {name}: "
                             "the planner's inputs are not lines in the batch")
    values: Dict[str, Any] = {"batch": batch}
    for f in fields(PlanInputs):
        if f.name == "batch":
            continue
        if f.name in _CONSTANT:
            values[f.name] = getattr(a, f.name)
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        values[f.name] = _on_lines(va, vb, a.batch, b.batch, batch)
    return PlanInputs(**values)


def _on_lines(va: Any, vb: Any, ba: int, bb: int, batch: int) -> Any:
    if isinstance(va, tuple):
        if len(va) != len(vb):
            raise ValueError(f"the steps at batch {ba} and {bb} differ in length: not lines in the batch")
        return tuple(_on_lines(x, y, ba, bb, batch) for x, y in zip(va, vb))
    return max(0, _line(va, vb, ba, bb, batch))


def _stat_bytes(layer: ChainLayer) -> int:
    """Bytes of the mean and inverse std a layer's BatchNorm saves (float32, freed after its
    BN backward: Note: [never above eager]); a per-sample norm's as its row of the norm table
    counts them (functional/norms.py)."""
    if isinstance(layer.bn, NormView):
        return stat_bytes(layer.bn.call(), layer.y_shape, 4, layer.bn.weight is not None) if layer.y_shape else 0
    return 0 if layer.bn is None else 2 * 4 * int(layer.bn.num_features)


def _norms(chain: FusedChain) -> Tuple[str, ...]:
    """A per-sample-norm chain's norm rows per layer (``""``: none); ``()`` for a BatchNorm chain."""
    if not any(isinstance(l.bn, NormView) for l in chain.layers):
        return ()
    return tuple(l.bn.call().row if isinstance(l.bn, NormView) else "" for l in chain.layers)


def _chain_param_bytes(chain: FusedChain) -> int:
    """Bytes of the gradients a chain's parameters get (conv weight and bias, BN weight and bias)."""
    return sum(_layer_param_bytes(l) for l in chain.layers)


def _layer_param_bytes(layer: ChainLayer) -> int:
    """Bytes of the gradients one layer's parameters get (conv, BN and tail parameters)."""
    return sum(t.numel() * t.element_size() for t in layer.parameters() if t.requires_grad)


def trained_outputs_loss(out: Any) -> Tensor:
    """The loss :func:`measure_peak` differentiates unless told otherwise: the sum of the means
    (in float32) of every output that requires grad, whichever position it has (a model may
    return an index or a mask first). Where none does, the step has no backward: a constant
    loss (backward does nothing; the peak measured is the forward's)."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    trained = [t.float().mean() for t in leaves if t.requires_grad and t.is_floating_point()]
    if trained:
        return sum(trained[1:], trained[0])
    return torch.zeros((), requires_grad=True)


def measure_peak(model: nn.Module, inputs: Tuple[Any, ...], *, optimizer: Optional[torch.optim.Optimizer] = None,
                 loss_fn: Optional[Callable[[Any], Tensor]] = None, stop_above: Optional[int] = None,
                 kernel_scratch: bool = False, backward_modules: bool = True) -> Any:
    """Timeline of one training step of ``model`` (loss: :func:`trained_outputs_loss`, unless ``loss_fn``);
    gradients, buffers, modes and RNG are put back afterwards (parameters too, unless an
    ``optimizer`` steps them). ``stop_above``: as :func:`~convbn.memory.timeline`'s (the step
    stopped by ``StepOverLimit`` past that many bytes); ``kernel_scratch`` and
    ``backward_modules``: as its too."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with StateSnapshot(model):
            model.train()
            return timeline(model, *inputs, optimizer=optimizer, loss_fn=loss_fn or trained_outputs_loss,
                            stop_above=stop_above, kernel_scratch=kernel_scratch,
                            backward_modules=backward_modules)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
