"""The memory of a per-sample-norm chain's backward, replayed on sizes alone.

:func:`norm_replay` is to :class:`~convbn.autograd.norm_chain.NormChainFunction` what
:func:`convbn.autograd.chain_memory.replay` is to the BatchNorm chain: its backward (Note: [a
per-sample norm layer's backward]) walked with numbers instead of tensors, each buffer allocated
and freed where the Function allocates and frees it, so that the planner predicts the peak of the
chain it runs, not of a BatchNorm chain's. What a norm costs is read off its row of the norm table
(:data:`convbn.functional.norms.NORMS`), never off its name:

* ``output_unread``: its backward reads its input and statistics, not its output, so under a ReLU-
  family activation the recomputed norm output is released at once (Note: [the norm's output as
  a root only]);
* ``stat_count``: its statistics (``s_sizes``, :func:`~convbn.functional.norms.stat_bytes`), alive
  with the recomputed norm.

What the Function *saves* (the chain input and the conv outputs its plan keeps) is
:meth:`convbn.passes.plan.peak_model.ChainCost.kept_bytes`, the same for both kinds of chain.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence, Tuple

from ..functional.norms import norm_row
from .chain_memory import LayerKind, SizeAllocator, TailOpCode, parse_kind

__all__ = ["norm_replay", "norm_conv_runs"]


class _NormReplay:
    """One replay of a per-sample-norm chain's backward (the arguments of :func:`norm_replay`)."""

    def __init__(self, y: Sequence[int], x: Sequence[int], keep: Sequence[bool], acts: Sequence[str],
                 norms: Sequence[str], w: Optional[Sequence[int]], head: bool, end: bool,
                 s: Optional[Sequence[int]], drops: Optional[Sequence[bool]] = None) -> None:
        self.y, self.x, self.norms, self.w, self.head, self.end = y, x, norms, w, head, end
        self.drops = list(drops) if drops is not None else [True] * len(y)
        self.k = k = len(y)
        parsed = [parse_kind(a) for a in acts]
        self.kinds, self.ops = [p[0] for p in parsed], [p[1] for p in parsed]
        self.s = list(s) if s else [0] * k
        #: the conv outputs forward saved (NormLayerSpec.saves_y), alive until their layer's norm backward
        self.kept = {i for i in range(k) if keep[i] and self.has_conv(i) and self.needs_y(i)}
        self.mem = SizeAllocator({("y", i): y[i] for i in self.kept} | {"g": y[-1]}, k - 1)
        #: per layer whose norm + tail graph is alive: the buffers it holds
        self.graphs: Dict[int, Tuple[Hashable, ...]] = {}

    def has_conv(self, i: int) -> bool:
        return not (self.head and i == 0)

    def has_norm(self, i: int) -> bool:
        return bool(self.norms[i])

    def needs_y(self, i: int) -> bool:
        """A norm or a tail follows the conv (else the layer's output is its conv's)."""
        return self.has_norm(i) or self.kinds[i] is not LayerKind.IDENTITY

    def root_only(self, i: int) -> bool:
        """Note: [the norm's output as a root only]: the activation's backward reads its output."""
        return self.kinds[i] is LayerKind.OUTPUT and self.has_norm(i) and norm_row(self.norms[i]).output_unread

    def norm_once(self, i: int) -> bool:
        """``norm_chain.norm_once``: a norm with nothing after it, its graph made once, before a
        layer that may not drop its rebuilt input."""
        return self.has_norm(i) and self.kinds[i] is LayerKind.IDENTITY and not self.drops[i + 1]

    def graph_holds_output(self, i: int) -> bool:
        """Layer ``i``'s graph holds its output (the next layer's input) as a tensor of its own."""
        return self.kinds[i] in (LayerKind.IDENTITY, LayerKind.TAIL) or self.root_only(i)

    def norm_forward(self, i: int, out: Hashable) -> None:
        """The norm of layer ``i`` computed into ``out``, its statistics beside it."""
        self.mem.alloc(("st", i), self.s[i])
        self.mem.alloc(out, self.y[i])

    def post_graph(self, i: int, out: Hashable) -> None:
        """Layer ``i``'s norm + tail under autograd from ``("y", i)`` (or the chain input), its
        output named ``out``; what the graph holds recorded in :attr:`graphs`."""
        mem, n = self.mem, self.y[i]
        held: Tuple[Hashable, ...] = (("y", i),) if self.has_conv(i) and i not in self.kept else ()
        if self.has_norm(i):
            self.norm_forward(i, ("z", i))
            held += (("z", i), ("st", i))
        z: Hashable = ("z", i) if self.has_norm(i) else ("y", i)
        if self.kinds[i] is LayerKind.TAIL:  # each op a new tensor autograd keeps
            for j, _ in enumerate(self.ops[i]):
                mem.alloc(("u", i, j), n)
                held += (("u", i, j),)
            mem.rename(held[-1], out)
            held = held[:-1] + (out,)
        elif self.kinds[i] is LayerKind.IDENTITY:
            if z == ("y", i) and self.has_conv(i):
                mem.alloc(out, 0)  # the output is the conv output itself
            else:
                mem.rename(z, out) if self.has_norm(i) else mem.alloc(out, 0)
            held = tuple(h for h in held if h != z) + (out,)
        elif self.root_only(i):  # the activation written over the norm's output: one map
            mem.rename(("z", i), out)
            held = tuple(h for h in held if h != ("z", i)) + (out,)
        else:
            mem.alloc(out, n)
        self.graphs[i] = held

    def build_x(self, i: int) -> None:
        """Layer ``i``'s input rebuilt from the nearest kept conv output before it (or the chain
        input), alive as ``("x", i)``; the last step's graph kept for layer ``i - 1``
        (``_Rebuild.input``: each map freed when the variable holding it is rebound)."""
        mem = self.mem
        j = max((m for m in self.kept if m < i), default=-1)
        cur: Optional[Hashable] = None  # the rebuilt input so far (None: the chain input)
        temp_y: Optional[Hashable] = None  # a recomputed conv output the loop's variable holds
        for m in range(max(j, 0), i - 1):
            once = m == i - 2 and self.norm_once(m)  # Note: [a norm before a dropped conv recomputed once]
            y_name = self._y_for(m, j, cur, name=("y", m) if once else None)
            self._drop(temp_y, keep=(cur, y_name))
            temp_y = y_name if y_name == ("ty", m) else None
            if once:  # the graph kept for layer m, its output for conv m + 1's backward
                self.post_graph(m, ("x", m + 1))
                t: Optional[Hashable] = ("x", m + 1)
            else:
                t = self._post_no_grad(m, y_name)
            self._drop(cur, keep=(t, temp_y))
            cur = t
        p = i - 1
        y_name = self._y_for(p, j, cur, name=("y", p))
        self._drop(temp_y, keep=(cur, y_name))
        self.post_graph(p, ("x", i))
        self._drop(cur, keep=(("x", i), ("x", p)))

    def _y_for(self, m: int, j: int, cur: Optional[Hashable], name: Optional[Hashable] = None) -> Optional[Hashable]:
        """Layer ``m``'s conv output in a rebuild: kept, the chain input, or recomputed."""
        if m == j:
            return ("y", m)
        if not self.has_conv(m):
            return cur
        name = name or ("ty", m)
        self.mem.alloc(name, self.y[m])
        return name

    def _drop(self, name: Optional[Hashable], keep: Sequence[Optional[Hashable]]) -> None:
        if name is not None and name not in keep and not (isinstance(name, tuple) and name[0] == "y"):
            self.mem.free(name)

    def _post_no_grad(self, m: int, y_name: Optional[Hashable]) -> Optional[Hashable]:
        """``tail(norm(y))`` without autograd: each op a new map, the previous one dropped."""
        mem, n = self.mem, self.y[m]
        t = y_name
        if self.has_norm(m):
            self.norm_forward(m, ("tz", m))
            mem.free(("st", m))
            t = ("tz", m)
        steps = len(self.ops[m]) if self.kinds[m] is LayerKind.TAIL else \
            int(self.kinds[m] is not LayerKind.IDENTITY)
        for o in range(steps):
            mem.alloc(("tu", m, o), n)
            if t != y_name:
                mem.free(t)
            t = ("tu", m, o)
        return t

    def layer_backward(self, i: int, g: Hashable) -> Hashable:
        """Layer ``i`` from the incoming gradient ``g``; returns its input's gradient's name.
        Each gradient is freed once consumed (the chain's own incoming one too: Note: [freeing
        the incoming gradient] in autograd/refcounts.py)."""
        mem, n = self.mem, self.y[i]
        if not self.needs_y(i):  # an end layer's bare convolution: its gradient is the incoming one
            mem.rename(g, "gy")
            return self.conv_backward(i)
        if i not in self.graphs:  # the last layer: nothing rebuilt its graph yet
            if i > 0 and self.has_conv(i) and i not in self.kept:
                self.build_x(i)
            if self.has_conv(i) and i not in self.kept:
                mem.alloc(("y", i), n)
            self.post_graph(i, ("out", i))
            if not self.graph_holds_output(i):
                mem.free(("out", i))
        held = self.graphs.pop(i)
        out = next((h for h in held if h in (("out", i), ("x", i + 1))), None)
        if self.root_only(i) and out is not None:  # grad_z written into the activation's output
            mem.free(g)
            g = out
        elif self.kinds[i] in (LayerKind.SMOOTH, LayerKind.OUTPUT):  # the activation's backward kernel
            mem.alloc(("ga", i), n)
            mem.free(g)
            g = ("ga", i)
        elif self.kinds[i] is LayerKind.TAIL:  # autograd through the tail, op by op
            for j, _ in enumerate(self.ops[i]):
                mem.alloc(("gt", i, j), n)
                if j:
                    mem.free(("gt", i, j - 1))
            mem.free(g)
            g = ("gt", i, len(self.ops[i]) - 1)
        if self.has_norm(i):
            self.norm_backward(i)
            mem.free(g)
        else:
            mem.rename(g, "gy")
        for h in held:
            mem.free(h)
        mem.free(("y", i))  # a kept conv output is read by its norm's backward only
        if not self.has_conv(i):
            return "gy"
        return self.conv_backward(i)

    def norm_backward(self, i: int) -> None:
        """The norm's input gradient as ``"gy"`` (its row's backward reads its input and
        statistics: no map besides)."""
        self.mem.alloc("gy", self.y[i])

    def conv_backward(self, i: int) -> Hashable:
        mem = self.mem
        if i > 0 and ("x", i) not in mem:
            self.build_x(i)
        if self.w is not None:
            mem.hold(("w", i), self.w[i])
        mem.alloc("gx", self.x[i])
        mem.free("gy")
        if i > 0 and not self.graph_holds_output(i - 1):
            mem.free(("x", i))
        mem.rename("gx", ("g", i))
        return ("g", i)

    def run(self) -> Tuple[int, int]:
        g: Hashable = "g"
        for i in reversed(range(self.k)):
            self.mem.layer = i
            g = self.layer_backward(i, g)
        return self.mem.peak, self.mem.peak_layer


def norm_replay(y_sizes: Sequence[int], x_sizes: Sequence[int], keep: Sequence[bool], acts: Sequence[str],
                norms: Sequence[str], w_sizes: Optional[Sequence[int]] = None, head: bool = False,
                end: bool = False, s_sizes: Optional[Sequence[int]] = None,
                drops: Optional[Sequence[bool]] = None) -> Tuple[int, int]:
    """Peak of a per-sample-norm chain's backward and the layer reaching it.

    Args:
        y_sizes, x_sizes, keep, acts, w_sizes, head, end: as :func:`~convbn.autograd.chain_memory.replay`'s.
        norms: each layer's norm, its :data:`~convbn.functional.norms.NORMS` row name (``""``:
            none, a bare convolution).
        s_sizes: each layer's statistics bytes (:func:`~convbn.functional.norms.stat_bytes`),
            made with its recomputed norm and held with its graph; ``None``: not counted.
        drops: per layer, ``NormLayerSpec.may_drop`` (Note: [a norm before a dropped conv
            recomputed once] in autograd/norm_chain.py); ``None``: every layer may drop.

    Returns:
        ``(peak, layer)``: counting the kept conv outputs, the incoming gradient and every
        buffer the backward creates (the chain input and the parameters not counted).

    Example:
        >>> norm_replay([4, 8], [1, 4], [False, False], ["smooth", "smooth"], ["group_norm", "group_norm"])
        (44, 1)
    """
    return _NormReplay(y_sizes, x_sizes, keep, acts, norms, w_sizes, head, end, s_sizes, drops).run()


def norm_conv_runs(keep: Sequence[bool], acts: Sequence[str], norms: Sequence[str], head: bool = False,
                   drops: Optional[Sequence[bool]] = None) -> Tuple[int, ...]:
    """How many times backward runs each layer's convolution again under ``keep``, walked in
    :class:`~convbn.autograd.norm_chain.NormChainFunction`'s order (Note: [a conv run once per
    rebuild]).

    # Note: [a conv run once per rebuild]
    # Each layer ``m >= 1`` with a convolution rebuilds its input once for its conv's backward
    # (``_Rebuild.input``): from the nearest kept conv output ``j < m`` (or the chain input),
    # running again the convolution of every layer ``j < i < m`` (of ``0 <= i < m`` where
    # nothing before is kept). A layer whose output no later layer rebuilt (the last one)
    # runs its own convolution for its norm's backward when not kept. So a layer not keeping
    # its output is recomputed once per later layer up to the next kept one, except where layer
    # ``m``'s input was kept by layer ``m + 1``'s rebuild (a norm with nothing after it before
    # the dropped conv ``m`` that may not drop it, ``drops[m]`` false: Note: [a norm before a
    # dropped conv recomputed once] in autograd/norm_chain.py): a fully recomputed ConvNeXt
    # block (dwconv -> LayerNorm, 1x1 -> GELU, 1x1) runs its depthwise conv twice, once where
    # its 1x1 conv may not drop its input. The planner's recompute cost counts each run
    # (``ChainCost.recompute``), with every layer dropping (the most runs: the planner clears
    # drops after choosing the plan).

    Example:
        >>> norm_conv_runs([False, False, False], ["identity", "smooth", "identity"], ["channel_layer_norm", "", ""])
        (2, 1, 0)
        >>> norm_conv_runs([False, False, False], ["identity", "smooth", "identity"], ["channel_layer_norm", "", ""],
        ...                drops=[False] * 3)
        (1, 1, 0)
        >>> norm_conv_runs([True, False, False], ["identity", "smooth", "identity"], ["channel_layer_norm", "", ""])
        (0, 1, 0)
    """
    k = len(keep)
    has_conv = [not (head and i == 0) for i in range(k)]
    needs_y = [bool(norms[i]) or parse_kind(acts[i])[0] is not LayerKind.IDENTITY for i in range(k)]
    kept = [keep[i] and has_conv[i] and needs_y[i] for i in range(k)]
    drops = list(drops) if drops is not None else [True] * k
    once = [bool(norms[i]) and parse_kind(acts[i])[0] is LayerKind.IDENTITY and not drops[i + 1] for i in range(k - 1)]
    runs = [0] * k
    for m in range(1, k):
        if not has_conv[m]:
            continue
        if m + 1 < k and has_conv[m + 1] and not kept[m] and once[m - 1]:
            continue  # Note: [a norm before a dropped conv recomputed once]: layer m + 1's rebuild kept it
        j = max((i for i in range(m) if kept[i]), default=-1)
        for i in range(j + 1, m):
            runs[i] += has_conv[i]
    last = k - 1
    if has_conv[last] and needs_y[last] and not kept[last]:
        runs[last] += 1
    return tuple(runs)
