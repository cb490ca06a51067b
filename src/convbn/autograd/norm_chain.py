"""The fused chain Function for per-sample norms (GroupNorm, InstanceNorm, channel LayerNorm).

``NormChainFunction.apply(x0, *params, specs, stats)`` computes
``tail_k(norm_k(conv_k(... tail_1(norm_1(conv_1(x0))) ...)))`` with the norms of
:data:`convbn.functional.norms.NORMS`, keeping for backward only the chain input ``x0`` (its
first convolution's weight gradient needs it) and, per layer whose plan keeps it, the
convolution's output ``y_i``; eager keeps every ``y_i``, every norm output and every
activation output.

Note: [a per-sample norm layer's backward]
Backward walks the layers from the last. A layer's input ``x_i`` is rebuilt from the nearest
kept conv output before it (``x_i = tail(norm(y_{i-1}))``, element-wise) or from ``x0``; its
``y_i`` is the kept one or its conv run again on ``x_i``. The norm and its tail are then run
*again under autograd* from ``y_i`` -- the very eager ops (``F.group_norm``, ``F.silu`` ...),
so their gradients are eager's bit for bit -- and differentiated with ``torch.autograd.grad``;
the convolution's gradients come from ``aten.convolution_backward`` as in BatchNorm chains.
Running statistics move once, in forward (the recompute normalises with the sample's own
statistics and passes no buffer). A differentiable backward (``create_graph=True``) rebuilds
the whole chain from ``x0`` and the parameters with the same ops (Note: [double backward]).
The slow, obviously right reference is :func:`norm_chain_reference` (eager ops end to end).
Each kept conv output is freed once its norm's backward read it (Note: [freeing kept tensors
early] in autograd/release.py), the incoming gradient once its last layer consumed it (Note:
[freeing the incoming gradient] in autograd/refcounts.py), and a bare end convolution's output is
never recomputed; the planner replays this order on sizes (autograd/norm_chain_memory.py).

Note: [a dropout in a per-sample norm chain]
A training dropout in a layer's tail draws its mask from the global RNG in forward, as eager's
module does (the same functional op, in the same order, so the global stream moves as eager's);
the generator's state just before each draw is kept (``capture_rng``: a few KiB, no tensor of the
activation's size). Every recompute of that tail -- backward's graph of the layer, the rebuild of
the next layer's input, the differentiable backward's reference -- runs the op under
``replay_rng`` with that state: the very mask, from a private generator, the global stream left
alone (Note: [dropout in a chain] in functional/tail.py). Autograd then differentiates the
dropout as eager's does. Under ``torch.compile`` such a chain runs its layers as eager modules
(``compilable_norm_chain``).

Note: [one autograd.grad per layer]
Each layer's recomputed norm + tail graph is differentiated by one engine call
(:func:`convbn._compat.engine_grad`: ``torch.autograd.grad``'s engine call without its argument
checks, whose Python costs tens of microseconds per layer: on an accelerator a chain's backward is
partly host-bound where maps are small). The gradient handed in has the root's shape by
construction; the engine, its arguments and so the gradients are ``torch.autograd.grad``'s.
``tests/test_norm_chain_ops.py`` bounds the operators a converted step dispatches by eager's plus
one recompute of each layer (``benchmarks/bm_norm_host.py`` prints both, and the host time).

Note: [a norm before a dropped conv recomputed once]
Where layer ``i``'s conv output is not kept, layer ``i + 1``'s input rebuild runs layer ``i - 1``'s
norm + tail to get ``x_i`` and conv ``i`` on it; layer ``i``'s conv backward needs ``x_i`` again.
For a norm with nothing after it (``norm_once``: ConvNeXt's LayerNorm before its 1x1 conv), where
layer ``i`` may not drop its rebuilt input (``NormLayerSpec.may_drop``), that first run is made
under autograd, its graph kept for layer ``i - 1``'s backward and ``x_i`` (the graph's root, held
by the graph anyway) kept for conv ``i``'s backward: the norm runs once per backward, not once
without a graph and again with it, and a conv before it that was recomputed for it runs once too.
``x_i`` (and a recomputed ``y_{i-1}`` the graph reads, and its statistics) is then alive from layer
``i + 1``'s conv backward on, not from conv ``i``'s: a higher peak for the chain. Dropping it
(``may_drop``, the default) is the old order, lower. The replay prices both
(autograd/norm_chain_memory.py ``build_x``), and the ``auto`` planner keeps it only where the
chain's backward then stays within the step's predicted peak (Note: [drops only where the step
peaks] in passes/plan/peak_model.py), so the step peaks where it predicts.

Note: [the norm's output as a root only]
Layer ``i``'s norm is recomputed under autograd once, when layer ``i + 1`` rebuilds its input,
and that graph waits for layer ``i``'s backward. Where the activation's derivative is a
function of its output (the ReLU family) and the norm's row says its backward never reads its
output (``output_unread``: GroupNorm, InstanceNorm and LayerNorm read their input and
statistics), the norm's output is only autograd's root: the activation is computed in place
over it (one map, not the norm's output and the activation's side by side; the same kernel as
the out-of-place call, so the same values) and the activation's backward reads the activation's
output, which the next convolution's backward needed anyway. No node of the recomputed graph
saved the norm's output, so writing over it changes no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._compat import engine_grad
from ..functional.activations import Activation
from ..functional.conv import ConvSpec, conv_backward, conv_forward
from ..functional.norms import NormCall, norm_forward, norm_reference, norm_row
from ..functional.tail import PReLUOp, RNGState, TailOp
from .double_backward import differentiable_backward
from .norm_chain_tail import norm_tail
from .refcounts import calibrate, incoming_refs, sole_owner
from .release import free_storage, keeping_graph
from .saving import load_tensors, save_tensors

__all__ = ["NormLayerSpec", "NormChainFunction", "norm_chain_apply", "norm_chain_forward_no_grad",
           "norm_chain_reference", "norm_once"]

Stats = Tuple[Optional[Tensor], Optional[Tensor]]
#: per layer, the RNG state before each dropout of its tail drew in forward (Note: [a dropout in a
#: per-sample norm chain])
Draws = Sequence[Sequence[RNGState]]


@dataclass(frozen=True)
class NormLayerSpec:
    """One layer of a per-sample-norm chain: ``[conv] -> [norm] -> tail``.

    Attributes:
        conv: the convolution's geometry (``None``: a pre-activation head, normalising ``x0``).
        norm: the norm's call (``None``: an end layer, a bare convolution).
        act: a single activation, or identity when ``tail`` is given.
        tail: element-wise ops after the norm (activations, PReLU and training dropouts).
        keep_y: keep the conv output for backward (else it is recomputed).
        may_drop: backward may drop this layer's rebuilt input and rebuild it again for its
            conv's backward, to lower the chain's own peak (Note: [a norm before a dropped conv
            recomputed once]; the ``auto`` planner clears it where the step peaks elsewhere).
    """

    conv: Optional[ConvSpec]
    norm: Optional[NormCall]
    act: Activation
    tail: Tuple[TailOp, ...] = ()
    keep_y: bool = True
    may_drop: bool = True

    def __post_init__(self) -> None:
        if self.conv is None and self.norm is None:
            raise ValueError("a norm chain layer needs a convolution, a norm or both")

    @property
    def n_params(self) -> int:
        return 2 * (self.conv is not None) + 2 * (self.norm is not None) + \
            sum(isinstance(op, PReLUOp) for op in self.tail)

    @property
    def saves_y(self) -> bool:
        """Whether forward keeps the conv output: kept by the plan, and needed (a norm or a tail follows)."""
        return self.keep_y and self.conv is not None and (self.norm is not None or bool(self.tail)
                                                          or not self.act.is_identity)


def _split(spec: NormLayerSpec, ps: Sequence[Optional[Tensor]]) -> Tuple[Any, Any, Any, Any, List[Any]]:
    it = iter(ps)
    w, b = (next(it), next(it)) if spec.conv is not None else (None, None)
    g, beta = (next(it), next(it)) if spec.norm is not None else (None, None)
    return w, b, g, beta, list(it)


def _post_slot(spec: NormLayerSpec, k: int) -> int:
    """Where entry ``k`` of ``[norm weight, norm bias, *tail weights]`` sits among the layer's
    parameters (:func:`_split`'s order): after the conv's two, and the norm's two only where the
    layer has a norm (an end layer's ``conv -> PReLU`` has no norm slots)."""
    return 2 * (spec.conv is not None) + (k if spec.norm is not None else k - 2)


def _offsets(specs: Sequence[NormLayerSpec]) -> List[int]:
    out = [0]
    for s in specs:
        out.append(out[-1] + s.n_params)
    return out


def _post(spec: NormLayerSpec, y: Tensor, g: Any, beta: Any, tws: Sequence[Tensor], stats: Stats,
          update: bool, capture: Optional[List[RNGState]] = None, replay: Optional[Sequence[RNGState]] = None
          ) -> Tensor:
    """``tail(norm(y))``; running statistics updated only where ``update``; dropout states
    captured or replayed as :func:`~convbn.autograd.norm_chain_tail.norm_tail` says."""
    if spec.norm is not None:
        y = norm_forward(y, spec.norm, g, beta, *stats) if update else norm_reference(y, spec.norm, g, beta, *stats)
    return norm_tail(spec.tail, spec.act, y, tws, spec.norm is not None, capture, replay)


def _conv(spec: NormLayerSpec, x: Tensor, w: Tensor, b: Optional[Tensor], first: bool) -> Tensor:
    """The layer's convolution; its input cast to the weight's dtype (autocast's cast of a conv
    module's operands: the caller casts the weights; Note: [a norm chain under autocast])."""
    return conv_forward((x if first else spec.conv.pad_input(x)).to(w.dtype), w, b, spec.conv)  # type: ignore[union-attr]


def _forward(x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
             stats: Sequence[Stats], draws: Optional[List[List[RNGState]]] = None
             ) -> Tuple[Tensor, Dict[int, Tensor]]:
    """The chain's output and the kept conv outputs (running statistics updated once); each
    layer's dropout states appended to ``draws[i]`` where given."""
    off = _offsets(specs)
    kept: Dict[int, Tensor] = {}
    x: Optional[Tensor] = x0
    for i, spec in enumerate(specs):
        w, b, g, beta, tws = _split(spec, params[off[i]: off[i + 1]])
        y = _conv(spec, x, w, b, i == 0) if spec.conv is not None else x  # type: ignore[arg-type]
        x = None  # the layer's input is dead once its conv ran (the caller holds x0)
        if spec.saves_y:
            kept[i] = y
        if spec.norm is None or spec.tail or spec.act.is_identity:
            x = _post(spec, y, g, beta, tws, stats[i], update=True, capture=None if draws is None else draws[i])
            continue
        z = norm_forward(y, spec.norm, g, beta, *stats[i])
        del y  # freed here unless kept
        # no autograd records this forward: the activation writes into the norm's fresh output,
        # one map fewer alive at the layer's end than eager's z and act(z)
        x = spec.act(z, inplace=True) if not _shares_storage(z, kept.get(i)) else spec.act(z)
    return x, kept  # type: ignore[return-value]


def _root_only(spec: NormLayerSpec) -> bool:
    """Note: [the norm's output as a root only]: a lone activation whose derivative is read off
    its output, after a norm whose backward never reads its output."""
    return (not spec.tail and not spec.act.is_identity and spec.act.output_derivable and spec.norm is not None
            and norm_row(spec.norm.row).output_unread)


def norm_once(spec: NormLayerSpec, after: NormLayerSpec) -> bool:
    """Note: [a norm before a dropped conv recomputed once]: a norm with nothing after it (a
    ConvNeXt block's LayerNorm before its 1x1 conv), whose graph holds its output anyway, before a
    layer ``after`` whose rebuilt input backward may not drop."""
    return spec.norm is not None and not spec.tail and spec.act.is_identity and not after.may_drop


def _alias(t: Tensor) -> Tensor:
    """A tensor on ``t``'s memory with a version counter of its own: writing through it leaves
    ``t`` as autograd recorded it (``t.detach()`` shares the counter, and a view whose counter
    moved has its ``grad_fn`` rebuilt as an ``AsStridedBackward0`` that copies a whole map)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _shares_storage(a: Tensor, b: Optional[Tensor]) -> bool:
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def norm_chain_forward_no_grad(x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                               stats: Sequence[Stats]) -> Tensor:
    """The chain where nothing needs a gradient: its forward, nothing kept."""
    with torch.no_grad():
        return _forward(x0, params, specs, stats)[0]


def norm_chain_reference(x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                         stats: Sequence[Stats] = (), draws: Optional[Draws] = None) -> Tensor:
    """The chain with eager, differentiable ops end to end (the slow reference; double backward).
    Running statistics update where ``stats`` gives them; dropouts draw from the global RNG, or
    replay forward's states where ``draws`` gives them."""
    off = _offsets(specs)
    x = x0
    for i, spec in enumerate(specs):
        w, b, g, beta, tws = _split(spec, params[off[i]: off[i + 1]])
        y = _conv(spec, x, w, b, i == 0) if spec.conv is not None else x
        x = _post(spec, y, g, beta, tws, stats[i] if stats else (None, None), update=bool(stats),
                  replay=None if draws is None else draws[i])
    return x


#: layer ``i``'s norm + tail run again under autograd: its conv output as a leaf, its norm and
#: tail parameters as leaves (``None`` where absent), the graph's root (the norm's output, or the
#: tail's), and the activation's output where its backward reads that instead of the root
PostGraph = Tuple[Tensor, List[Optional[Tensor]], Tensor, Optional[Tensor]]


class _Rebuild:
    """Each layer's input and conv output in backward (Note: [a per-sample norm layer's backward]).

    The input of layer ``i`` is layer ``i - 1``'s norm + tail output: it is computed under
    autograd and that graph kept (``pending``) for layer ``i - 1``'s backward, which runs next,
    so the element-wise recompute runs once per layer."""

    def __init__(self, x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                 kept: Dict[int, Tensor], stats: Sequence[Stats], needs: Sequence[bool], draws: Draws) -> None:
        self.x0, self.params, self.specs, self.kept, self.stats = x0, params, specs, kept, stats
        self.draws = draws  # each layer's dropout states, replayed in every recompute of its tail
        self.off, self.needs = _offsets(specs), needs
        #: each layer's parameters as ``_split`` gives them (read several times per layer)
        self.split = [_split(s, params[self.off[i]: self.off[i + 1]]) for i, s in enumerate(specs)]
        self.pending: Dict[int, PostGraph] = {}
        #: layer inputs rebuilt with their producer's graph, waiting for their conv's backward
        #: (Note: [a norm before a dropped conv recomputed once])
        self.inputs: Dict[int, Tensor] = {}
        #: no later backward unpacks the saved conv outputs: each is freed once read
        self.free_kept = not keeping_graph()
        #: the Function's incoming gradient where it is the backward's alone, freed once consumed
        self.engine_grad: Optional[Tensor] = None

    def release_engine_grad(self, unless: Optional[Tensor] = None) -> None:
        """Free the incoming gradient (Note: [freeing the incoming gradient] in
        autograd/refcounts.py) unless ``unless`` is it or shares its storage."""
        g = self.engine_grad
        if g is None or (unless is not None and unless.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()):
            return
        self.engine_grad = None
        free_storage(g)

    def layer(self, i: int) -> Tuple[Any, Any, Any, Any, List[Any]]:
        return self.split[i]

    def y(self, i: int, x: Optional[Tensor]) -> Tensor:
        """Layer ``i``'s conv output (its input where it has no conv)."""
        if i in self.kept:
            return self.kept[i]
        spec = self.specs[i]
        x = x if x is not None else self.input(i)
        if spec.conv is None:
            return x
        w, b, *_ = self.layer(i)
        return _conv(spec, x, w, b, i == 0)

    def post_graph(self, i: int, y: Tensor) -> Tuple[PostGraph, Tensor]:
        """Layer ``i``'s norm + tail on ``y`` under autograd (statistics read, never updated), and
        its output. A lone activation stays out of the graph (its backward is the native kernel
        :meth:`~convbn.functional.activations.Activation.backward` eager's autograd runs), so the
        graph keeps the norm's output, not the activation's."""
        spec = self.specs[i]
        _, _, g, beta, tws = self.layer(i)
        with torch.enable_grad():
            yv = y.detach().requires_grad_(True)
            pv = [None if p is None else p.detach().requires_grad_(self.needs[self.off[i] + _post_slot(spec, k)])
                  for k, p in enumerate([g, beta, *tws])]
            if spec.tail:
                out = _post(spec, yv, pv[0], pv[1], pv[2:], self.stats[i], update=False, replay=self.draws[i])
                return (yv, pv, out, None), out.detach()
            z = norm_reference(yv, spec.norm, pv[0], pv[1], *self.stats[i]) if spec.norm is not None else yv
        if _root_only(spec) and not _shares_storage(z, yv):
            # Note: [the norm's output as a root only]: its backward reads its input and statistics,
            # the activation's backward its output: the activation is written over the norm's
            # output, whose tensor stays autograd's root only (no node of the graph saved it)
            with torch.no_grad():
                a = spec.act(_alias(z), inplace=True)
            return (yv, pv, z, a), a.detach()
        with torch.no_grad():
            a = z if spec.act.is_identity else spec.act(z)
        return (yv, pv, z, None), a.detach()

    def input(self, i: int) -> Tensor:
        """Layer ``i``'s input, from the nearest kept conv output before it, or from ``x0``; the
        last step's graph is kept for layer ``i - 1``'s backward."""
        if i == 0:
            return self.x0
        if i in self.inputs:
            return self.inputs.pop(i)
        j = i - 1
        while j >= 0 and j not in self.kept:
            j -= 1
        x = self.x0 if j < 0 else None
        for k in range(max(j, 0), i - 1):
            y = self.kept[k] if k == j else self.y(k, x)
            # Note: [a norm before a dropped conv recomputed once]
            if k == i - 2 and norm_once(self.specs[k], self.specs[k + 1]):
                self.pending[k], x = self.post_graph(k, y)
                self.inputs[i - 1] = x
                continue
            _, _, g, beta, tws = self.layer(k)
            with torch.no_grad():
                x = _post(self.specs[k], y, g, beta, tws, self.stats[k], update=False, replay=self.draws[k])
        y = self.kept[i - 1] if j == i - 1 else self.y(i - 1, x)
        self.pending[i - 1], out = self.post_graph(i - 1, y)
        return out


def _layer_backward(rb: _Rebuild, i: int, grad: List[Tensor], x_need: bool, grads: List[Optional[Tensor]]
                    ) -> Optional[Tensor]:
    """Gradients of layer ``i``'s parameters into ``grads`` (flat parameter order, where
    ``rb.needs``); returns the gradient of its input (``None`` for the first layer unless
    ``x_need``). ``grad`` holds the incoming gradient and is emptied once read, so that it can
    be freed before the convolution's backward; the layer's input is rebuilt after its norm's
    backward where its conv output was kept (fewer maps alive at once)."""
    spec = rb.specs[i]
    w, b, *_ = rb.layer(i)
    x: Optional[Tensor] = rb.x0 if (spec.conv is None or i == 0) else None
    if i == len(rb.specs) - 1 and spec.norm is None and not spec.tail and spec.act.is_identity:  # a bare end conv
        return _conv_backward(rb, i, grad.pop(), x, x_need, grads)
    graph = rb.pending.pop(i, None)
    if graph is None:
        if i not in rb.kept and spec.conv is not None and x is None:
            x = rb.input(i)
        graph = rb.post_graph(i, rb.y(i, x))[0]
    yv, pv, out, act_out = graph
    base = rb.off[i]
    g = grad.pop()
    if act_out is not None:  # Note: [the norm's output as a root only]
        g = spec.act.backward_from_output_(g, act_out)
    elif not spec.tail and not spec.act.is_identity:  # the activation's native backward kernel
        g = spec.act.backward(g, out.detach())
    rb.release_engine_grad(unless=g)
    wanted = [yv] + [p for p in pv if p is not None and p.requires_grad]
    got = list(engine_grad(out, wanted, g)) if out is not yv else [g]  # Note: [one autograd.grad per layer]
    del g
    gy, rest = got[0], iter(got[1:])
    rb.release_engine_grad(unless=gy)
    for k, p in enumerate(pv):
        if p is not None and p.requires_grad:
            gp = next(rest)
            grads[base + _post_slot(spec, k)] = torch.zeros_like(p) if gp is None else gp
    if gy is None:
        gy = torch.zeros_like(yv)
    # ``wanted`` holds ``yv``: a recomputed conv output would otherwise live through the conv's backward
    del out, yv, pv, graph, got, act_out, wanted
    kept = rb.kept.pop(i, None)  # a kept conv output is read by its norm's backward only
    if kept is not None and rb.free_kept:  # Note: [freeing kept tensors early] in autograd/release.py
        free_storage(kept)
    del kept
    if spec.conv is None:
        return gy
    return _conv_backward(rb, i, gy, x, x_need, grads)


def _conv_backward(rb: _Rebuild, i: int, gy: Tensor, x: Optional[Tensor], x_need: bool,
                   grads: List[Optional[Tensor]]) -> Optional[Tensor]:
    """Layer ``i``'s convolution's gradients from ``gy`` (its input rebuilt where not given)."""
    spec, base = rb.specs[i], rb.off[i]
    w, b, *_ = rb.layer(i)
    if x is None:
        x = rb.input(i)
    needs = rb.needs
    xin = (spec.conv.pad_input(x) if i > 0 else x).to(w.dtype)
    # Note: [the weight's gradient first] in functional/conv.py: on the CPU the weight kernel's
    # scratch never lands on top of the input's gradient
    gx, gw, gb = conv_backward(gy, xin, w, spec.conv, (i > 0 or x_need, needs[base], b is not None and needs[base + 1]),
                               weight_first=xin.device.type == "cpu")
    grads[base], grads[base + 1] = gw, gb
    gx = None if gx is None else gx.to(x.dtype)  # back through the input's cast
    rb.release_engine_grad(unless=gx)
    if i > 0 and bool(spec.conv.pre_pad) and gx is not None:  # through the padding of an absorbed pad
        with torch.enable_grad():
            xv = x.detach().requires_grad_(True)
            gx = torch.autograd.grad(spec.conv.pad_input(xv), xv, gx)[0]
    return gx


class NormChainFunction(torch.autograd.Function):
    """``apply(x0, *params, specs, stats)``: see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x0: Tensor, *args: Any) -> Tensor:  # type: ignore[override]
        calibrate()  # Note: [calibrated once, in a clean state] (autograd/refcounts.py)
        *params, specs, stats = args
        draws: List[List[RNGState]] = [[] for _ in specs]
        out, kept = _forward(x0, params, specs, stats, draws)
        ctx.draws = tuple(tuple(d) for d in draws)  # a few KiB per dropout, no tensor of activation size
        ctx.kept_idx = tuple(kept)
        save_tensors(ctx, (x0, *params, *kept.values()))
        ctx.autocast = _autocast_state(x0)
        ctx.specs, ctx.stats_given = tuple(specs), tuple(stats)
        ctx.n_params = len(params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refs = incoming_refs(grad_out)  # first: Note: [freeing the incoming gradient]
        dev, enabled, dtype = ctx.autocast
        if dev is None:
            return NormChainFunction._backward(ctx, grad_out, refs)
        with torch.autocast(dev, dtype=dtype, enabled=enabled):  # the recompute under forward's autocast state
            return NormChainFunction._backward(ctx, grad_out, refs)

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor, refs: int) -> Tuple[Optional[Tensor], ...]:
        saved = load_tensors(ctx)
        n = ctx.n_params
        x0, params = saved[0], saved[1: 1 + n]
        specs: Tuple[NormLayerSpec, ...] = ctx.specs
        # statistics are read (never updated) in backward: only where a norm normalises by them
        stats = [s if (sp.norm is not None and not sp.norm.use_input_stats) else (None, None)
                 for s, sp in zip(ctx.stats_given, specs)]
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # Note: [double backward] in autograd/double_backward.py
            grads = differentiable_backward(ctx, grad_out, (x0, *params),
                                            lambda x, *ps: norm_chain_reference(x, ps, specs, stats, ctx.draws),
                                            needs=needs[: 1 + n])
            return (*grads[: 1 + n], None, None)
        kept = dict(zip(ctx.kept_idx, saved[1 + n:]))
        rb = _Rebuild(x0, params, specs, kept, stats, needs[1: 1 + n], ctx.draws)  # type: ignore[arg-type]
        rb.engine_grad = grad_out if sole_owner(grad_out, refs) else None
        flat: List[Optional[Tensor]] = [None] * n
        g: Optional[Tensor] = grad_out
        del grad_out
        for i in reversed(range(len(specs))):
            holder = [g]
            g = None
            g = _layer_backward(rb, i, holder, needs[0], flat)  # type: ignore[arg-type]
            rb.kept.pop(i, None)
        return (g if needs[0] else None, *flat, None, None)


def _autocast_state(x: Tensor) -> Tuple[Optional[str], bool, Optional[torch.dtype]]:
    """Note: [a norm chain under autocast] Forward runs under the caller's autocast state (the
    norms and tails get autocast's own casts; ``_conv`` casts each conv input to its weight's
    dtype, the weights coming cast by the caller): backward recomputes under the same state,
    whatever the state it is called in."""
    dev = x.device.type
    if dev not in ("cpu", "cuda"):
        return None, False, None
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def norm_chain_apply(x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                     stats: Sequence[Stats]) -> Tensor:
    """One call of a per-sample-norm chain: the no-grad forward where nothing needs a gradient,
    else :class:`NormChainFunction`."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x0, *params))):
        return norm_chain_forward_no_grad(x0, params, specs, stats)
    return NormChainFunction.apply(x0, *params, tuple(specs), tuple(stats))
