"""The memory of a chain's backward, replayed on sizes alone.

:func:`replay` walks the layers in the order of :func:`convbn.autograd.chain.chain_backward`
(Note: [chain backward order]) with numbers instead of tensors: kept and recomputed conv
outputs, rebuilt inputs, the incoming gradient, grad_z, grad_y and grad_x, each
allocated and freed where the real backward does (:class:`SizeAllocator`). It serves twice:
the backward asks :func:`choose_drops` which rebuilt inputs are worth dropping and rebuilding
(an extra element-wise pass) because that lowers its peak, and the planner
(:func:`convbn.passes.plan.peak_model.chain_backward_peak`) predicts each plan's peak with it.
No tensors, no kernels: what a layer's tail costs is read off the activation table
(:func:`layer_kind` / :func:`activation_kind`).
"""
from __future__ import annotations

import enum
import functools
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..functional.activations import Activation
from ..functional.tail import DropoutOp, PReLUOp, TailOp

__all__ = ["replay", "choose_drops", "ACT_KINDS", "LayerKind", "TailOpCode", "SizeAllocator",
           "activation_kind", "tail_kind", "layer_kind", "parse_kind"]


class LayerKind(str, enum.Enum):
    """What a layer's backward needs of its tail, as far as memory goes.

    ``IDENTITY``: no backward; ``OUTPUT``: one activation whose derivative is a function of its
    output (the ReLU family, :attr:`Activation.output_derivable`), written into the rebuilt
    output; ``SMOOTH``: one activation whose derivative needs the recomputed ``z``; ``TAIL``: a
    general tail (PReLU, dropout, several ops), replayed op by op (:class:`TailOpCode`) as
    autograd/chain_tail.py runs it (Note: [general tail backward]).
    """

    IDENTITY = "identity"
    OUTPUT = "output"
    SMOOTH = "smooth"
    TAIL = "tail"


class TailOpCode(str, enum.Enum):
    """One op of a general tail, as the replay sees it (its code in a kind string)."""

    ACTIVATION = "A"
    PRELU = "P"
    DROPOUT = "D"  # a new output, and a noise buffer while it draws
    DROPOUT_INPLACE = "d"  # its noise buffer only

    @property
    def needs_input(self) -> bool:
        """Its backward reads its input (an activation's derivative, PReLU's)."""
        return self in (TailOpCode.ACTIVATION, TailOpCode.PRELU)

    @property
    def is_dropout(self) -> bool:
        return self in (TailOpCode.DROPOUT, TailOpCode.DROPOUT_INPLACE)


#: a layer's kind as the string :func:`replay` takes (hashable: :func:`choose_drops` caches on
#: it): ``"identity"``, ``"output"``, ``"smooth"``, or ``"tail:"`` and one
#: :class:`TailOpCode` per op (``"tail:DA"``: a dropout, then an activation)
ACT_KINDS = ("identity", "output", "smooth", "tail:...")


def activation_kind(act: Activation) -> str:
    """The kind of a layer whose tail is the one activation ``act`` (read off its table record).

    Example:
        >>> activation_kind(Activation("relu")), activation_kind(Activation("silu"))
        ('output', 'smooth')
    """
    if act.is_identity:
        return LayerKind.IDENTITY.value
    return (LayerKind.OUTPUT if act.output_derivable else LayerKind.SMOOTH).value


def tail_kind(ops: Sequence[TailOp]) -> str:
    """The kind string of a general tail of ``ops`` (activations, PReLUs, dropouts)."""
    def code(op: TailOp) -> TailOpCode:
        if isinstance(op, DropoutOp):
            return TailOpCode.DROPOUT_INPLACE if op.inplace else TailOpCode.DROPOUT
        return TailOpCode.PRELU if isinstance(op, PReLUOp) else TailOpCode.ACTIVATION
    return LayerKind.TAIL.value + ":" + "".join(code(op).value for op in ops)


def layer_kind(act: Activation, tail: Sequence[TailOp] = ()) -> str:
    """The kind of a layer with the one activation ``act`` or, where given, the general ``tail``."""
    return tail_kind(tail) if tail else activation_kind(act)


def parse_kind(kind: str) -> Tuple[LayerKind, Tuple[TailOpCode, ...]]:
    """``kind`` (one of :data:`ACT_KINDS`) as its :class:`LayerKind` and tail ops.

    Raises:
        ValueError: ``kind`` is none of :data:`ACT_KINDS`, or a tail op code is unknown.
    """
    if kind.startswith("tail:"):
        return LayerKind.TAIL, tuple(TailOpCode(c) for c in kind[5:])
    try:
        return LayerKind(kind), ()
    except ValueError:
        raise ValueError(f"a layer kind must be one of {ACT_KINDS}, but got {kind!r}") from None


class SizeAllocator:
    """Named buffers and their sizes, the running total's peak and the layer it was reached in.

    Args:
        live: the buffers alive at the start (counted in the first peak).
        layer: the layer the walk starts in.
    """

    def __init__(self, live: Dict[Hashable, int], layer: int) -> None:
        self.live = dict(live)
        self.layer = layer
        self.peak = sum(self.live.values())
        self.peak_layer = layer

    def __contains__(self, name: Hashable) -> bool:
        return name in self.live

    def alloc(self, name: Hashable, n: int) -> None:
        """``name`` now holds ``n`` (a new buffer, or a resize); the peak is checked."""
        self.live[name] = n
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_layer = total, self.layer

    def hold(self, name: Hashable, n: int) -> None:
        """``name`` holds ``n`` from now on; counted from the next :meth:`alloc`."""
        self.live[name] = n

    def free(self, name: Hashable) -> None:
        """``name`` freed (nothing where it is not alive)."""
        self.live.pop(name, None)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """The buffer ``old`` reused as ``new`` (written in place: no new bytes)."""
        self.live[new] = self.live.pop(old)


class _ChainReplay:
    """One replay of a chain's backward (the arguments of :func:`replay`)."""

    def __init__(self, y_sizes: Sequence[int], x_sizes: Sequence[int], keep: Sequence[bool], acts: Sequence[str],
                 drop: Sequence[bool], w_sizes: Optional[Sequence[int]], head: bool, end: bool,
                 s_sizes: Optional[Sequence[int]]) -> None:
        self.y, self.x, self.drop, self.w = y_sizes, x_sizes, drop, w_sizes
        self.head, self.end = head, end
        self.k = k = len(y_sizes)
        parsed = [parse_kind(a) for a in acts]
        self.kinds = [p[0] for p in parsed]
        self.ops = [p[1] for p in parsed]
        live: Dict[Hashable, int] = {("y", i): y_sizes[i] for i in range(k) if keep[i] and self.needs_y(i)}
        live["g"] = y_sizes[-1]
        for i, n in enumerate(s_sizes or ()):
            if n:
                live[("st", i)] = n
        self.mem = SizeAllocator(live, k - 1)

    def needs_y(self, i: int) -> bool:
        """Layer ``i``'s backward reads its conv output."""
        return not (self.head and i == 0) and not (self.end and i == self.k - 1
                                                   and self.kinds[i] is LayerKind.IDENTITY)

    def get_y(self, i: int) -> None:
        """Layer ``i``'s conv output alive as ``("y", i)``: kept, or recomputed from its input."""
        if ("y", i) in self.mem or (self.head and i == 0):
            return
        if i > 0 and ("x", i) not in self.mem:
            self.build_x(i)
        self.mem.alloc(("y", i), self.y[i])
        if i > 0 and self.drop[i]:
            self.mem.free(("x", i))

    def build_x(self, i: int) -> None:
        """Layer ``i``'s input rebuilt from ``y_{i-1}``, alive as ``("x", i)``."""
        mem, prev = self.mem, i - 1
        self.get_y(prev)
        if self.kinds[prev] is LayerKind.TAIL:
            self._rebuild_through_tail(i)
        elif self.kinds[prev] is LayerKind.SMOOTH:
            mem.alloc(("z", prev), self.y[prev])
            mem.alloc(("x", i), self.x[i])
            mem.free(("z", prev))
        else:
            mem.alloc(("x", i), self.x[i])

    def _rebuild_through_tail(self, i: int) -> None:
        """``build_x`` through layer ``i - 1``'s general tail, each op on a buffer of its own."""
        mem, n = self.mem, self.y[i - 1]
        mem.alloc(("u", i), n)  # z
        for op in self.ops[i - 1]:
            if op is TailOpCode.ACTIVATION:  # in place on the tail's own buffer
                continue
            if op is TailOpCode.DROPOUT_INPLACE:
                mem.alloc("noise", n)
                mem.free("noise")
                continue
            if op is TailOpCode.DROPOUT:  # a new output; a dropout's noise transient
                mem.alloc("noise", n)
            mem.alloc(("u2", i), n)
            mem.free("noise")
            mem.rename(("u2", i), ("u", i))
        mem.rename(("u", i), ("x", i))
        if self.x[i] != n:  # a constant pre-pad copies
            mem.alloc(("x", i), self.x[i])

    def tail_backward(self, i: int, grad: Hashable) -> Hashable:
        """Note: [general tail backward]: rebuild inputs up to the last op that needs one, then
        walk back; returns the name of grad_z. The incoming gradient is freed by the caller."""
        saved = self._tail_recompute(i)
        return self._tail_walk_back(i, saved, grad)

    def _tail_recompute(self, i: int) -> Dict[int, Hashable]:
        """The tail's forward up to its last op whose backward reads an input: which buffer
        holds each such op's input."""
        mem, n, ops = self.mem, self.y[i], self.ops[i]
        y_i: Hashable = ("y", i)
        owned = not (self.end and i == self.k - 1)  # an end layer's tail reads its conv output itself
        if owned:
            mem.alloc(("u", i, 0), n)  # recomputed z
        last = max((j for j, op in enumerate(ops) if op.needs_input), default=-1)
        cur: Hashable = ("u", i, 0) if owned else y_i
        saved: Dict[int, Hashable] = {}
        for j, op in enumerate(ops):
            if op.needs_input:
                saved[j] = cur
            if j >= last:
                break
            nxt = ("u", i, j + 1)
            if op is not TailOpCode.DROPOUT_INPLACE:
                if op is TailOpCode.DROPOUT:
                    mem.alloc("noise", n)
                mem.alloc(nxt, n)
                mem.free("noise")
            else:  # in-place dropout: its noise only (a copy first where the buffer is not its own)
                mem.alloc("noise", n)
                mem.free("noise")
                if cur == y_i:
                    mem.alloc(nxt, n)
                else:
                    mem.rename(cur, nxt)
            if op.is_dropout and cur != y_i and cur not in saved.values():
                mem.free(cur)
            cur = nxt
        if cur not in saved.values() and cur != y_i:
            mem.free(cur)
        return saved

    def _tail_walk_back(self, i: int, saved: Dict[int, Hashable], grad: Hashable) -> Hashable:
        """The tail's backward, last op first, from the inputs ``saved`` kept."""
        mem, n, ops = self.mem, self.y[i], self.ops[i]
        g = grad
        for j in reversed(range(len(ops))):
            op = ops[j]
            new: Hashable = ("gt", i, j)
            if op.is_dropout:  # the slope regenerated on a buffer of ones
                mem.alloc(("s", i), n)
                mem.alloc("noise", n)
                if op is TailOpCode.DROPOUT:
                    mem.alloc(("s2", i), n)
                    mem.free("noise")
                    mem.free(("s", i))
                    mem.rename(("s2", i), ("s", i))
                else:
                    mem.free("noise")
                mem.alloc(new, n)
                mem.free(("s", i))
            elif op is TailOpCode.PRELU:
                mem.alloc(new, n)
                mem.alloc("gw", n)  # PReLU's weight gradient before its reduction
                mem.free("gw")
                mem.free(saved[j])
            elif saved[j] == ("y", i):
                mem.alloc(new, n)
            else:  # the derivative written into the consumed input
                mem.rename(saved[j], new)
            if g != grad:
                mem.free(g)
            g = new
        return g

    def bn_and_tail_backward(self, i: int, grad: Hashable) -> None:
        """Layer ``i`` from the incoming gradient ``grad`` to grad_y (alive as ``"gy"``)."""
        mem, kind = self.mem, self.kinds[i]
        last_end = self.end and i == self.k - 1
        if not (self.needs_y(i) or (self.head and i == 0)):  # an end layer without tail
            mem.rename(grad, "gy")
            return
        self.get_y(i)
        if kind is LayerKind.OUTPUT and ("x", i + 1) in mem:
            mem.free(grad)
            grad = ("x", i + 1)  # grad_z written into the rebuilt output
        elif kind is LayerKind.TAIL:
            grad = self.tail_backward(i, grad)
        elif kind is not LayerKind.IDENTITY:
            mem.alloc(("z", i), self.y[i])  # recomputed z, overwritten by grad_z
            mem.free(grad)
            grad = ("z", i)
        if last_end:  # no BN: the tail's gradient goes to the conv
            mem.rename(grad, "gy")
        else:
            mem.alloc("gy", self.y[i])  # BN backward
            mem.free(grad)
        mem.free(("y", i))
        mem.free(("st", i))

    def conv_backward(self, i: int) -> None:
        """Layer ``i``'s conv backward from ``"gy"``: its input's gradient alive as ``"g2"``."""
        mem = self.mem
        if i > 0 and ("x", i) not in mem:
            self.build_x(i)
        if self.w is not None:
            mem.hold(("w", i), self.w[i])  # grad_weight, with grad_x below
        mem.alloc("gx", self.x[i])
        mem.free("gy")
        if i > 0 and self.kinds[i - 1] is not LayerKind.OUTPUT:
            mem.free(("x", i))
        mem.rename("gx", "g2")

    def run(self) -> Tuple[int, int]:
        grad: Hashable = "g"
        for i in reversed(range(self.k)):
            self.mem.layer = i
            self.bn_and_tail_backward(i, grad)
            if self.head and i == 0:
                break  # grad_y is the chain input's gradient
            self.conv_backward(i)
            grad = "g2"
        return self.mem.peak, self.mem.peak_layer


def replay(
    y_sizes: Sequence[int],
    x_sizes: Sequence[int],
    keep: Sequence[bool],
    acts: Sequence[str],
    drop: Sequence[bool],
    w_sizes: Optional[Sequence[int]] = None,
    head: bool = False,
    end: bool = False,
    s_sizes: Optional[Sequence[int]] = None,
) -> Tuple[int, int]:
    """Peak of the chain's backward and the layer reaching it.

    Args:
        y_sizes: each layer's conv output size (bytes or elements, one unit throughout).
        x_sizes: each layer's conv input size (``x_sizes[0]``: the chain input, always kept,
            not counted).
        keep: which conv outputs were kept from forward.
        acts: each layer's kind from :data:`ACT_KINDS` (:func:`activation_kind`, :func:`tail_kind`).
        drop: for a layer whose output is recomputed, drop its rebuilt input right after
            the recompute and rebuild it after BN backward (instead of holding it).
        w_sizes: each layer's parameter-gradient size (conv weight and bias, BN weight and
            bias), made by its conv backward and held to the end of the chain's backward
            (the Function returns them together); ``None``: not counted.
        head: layer 0 has no conv: its BN input is the chain input (``y_sizes[0]`` its size;
            never allocated nor counted), its BN backward gives the chain input's gradient.
        end: the last layer has no BN: its backward needs its conv output only for a
            tail (kind not ``"identity"``), and the gradient reaching the conv is its tail's.
        s_sizes: each layer's saved BatchNorm statistics (mean and inverse std), alive from
            the start and freed right after its BN backward; ``None``: not counted.

    Returns:
        ``(peak, layer)``: counting the kept outputs, the incoming gradient (freed once
        consumed) and every buffer the backward creates.

    Example:
        >>> replay([4, 8], [1, 4], [False, True], ["output", "output"], [False, False])  # two ReLU layers
        (24, 1)
    """
    return _ChainReplay(y_sizes, x_sizes, keep, acts, drop, w_sizes, head, end, s_sizes).run()


def choose_drops(
    y_sizes: Sequence[int], x_sizes: Sequence[int], keep: Sequence[bool], acts: Sequence[str],
    head: bool = False, end: bool = False, allowed: Optional[Sequence[bool]] = None,
) -> List[bool]:
    """Which recomputed layers should drop their rebuilt input during BN backward: each
    one, in turn, whose drop lowers the replayed peak (a drop costs one element-wise
    rebuild, so it is taken only where it pays in memory). ``allowed``: the layers that
    may drop at all (default: every one); the planner forbids drops in a chain whose
    backward is not where the step peaks (Note: [drops only where the step peaks] in
    passes/plan/peak_model.py)."""
    # every backward of a chain asks the same question: answered once per shape and plan
    args = (tuple(y_sizes), tuple(x_sizes), tuple(bool(f) for f in keep), tuple(acts), head, end,
            None if allowed is None else tuple(bool(f) for f in allowed))
    try:
        return list(_choose_drops(*args))
    except TypeError:  # unhashable sizes (symbolic shapes): not cached
        return list(_choose_drops.__wrapped__(*args))


@functools.lru_cache(maxsize=4096)
def _choose_drops(y_sizes: Tuple[int, ...], x_sizes: Tuple[int, ...], keep: Tuple[bool, ...], acts: Tuple[str, ...],
                  head: bool, end: bool, allowed: Optional[Tuple[bool, ...]]) -> Tuple[bool, ...]:
    k = len(y_sizes)
    drop = [False] * k
    if allowed is not None and not any(allowed):
        return tuple(drop)
    best = replay(y_sizes, x_sizes, keep, acts, drop, head=head, end=end)[0]
    for i in range(1, k):
        if keep[i] or (end and i == k - 1 and acts[i] == "identity") or (allowed is not None and not allowed[i]):
            continue
        drop[i] = True
        peak = replay(y_sizes, x_sizes, keep, acts, drop, head=head, end=end)[0]
        if peak < best:
            best = peak
        else:
            drop[i] = False
    return tuple(drop)
