"""The memory of a chain's backward, replayed on sizes alone.

:func:`replay` walks the layers in the order of :func:`convbn.autograd.chain.chain_backward`
(Note: [chain backward order]) with numbers instead of tensors: kept and recomputed conv
outputs, rebuilt inputs, the incoming gradient, grad_z, grad_y and grad_x, each
allocated and freed where the real backward does. It serves twice: the backward asks
:func:`choose_drops` which rebuilt inputs are worth dropping and rebuilding (an extra
element-wise pass) because that lowers its peak, and the planner
(:func:`convbn.passes.planner.chain_backward_peak`) predicts each plan's peak with it.
Pure Python: no tensors, no torch.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["replay", "choose_drops", "ACT_KINDS"]

#: activation kinds: no backward; derivative from the output (ReLU family); from ``z``
ACT_KINDS = ("identity", "output", "smooth")


def replay(
    y_sizes: Sequence[int],
    x_sizes: Sequence[int],
    keep: Sequence[bool],
    acts: Sequence[str],
    drop: Sequence[bool],
    w_sizes: Optional[Sequence[int]] = None,
) -> Tuple[int, int]:
    """Peak of the chain's backward and the layer reaching it.

    Args:
        y_sizes: each layer's conv output size (bytes or elements, one unit throughout).
        x_sizes: each layer's conv input size (``x_sizes[0]``: the chain input, always kept,
            not counted).
        keep: which conv outputs were kept from forward.
        acts: each layer's kind from :data:`ACT_KINDS`.
        drop: for a layer whose output is recomputed, drop its rebuilt input right after
            the recompute and rebuild it after BN backward (instead of holding it).
        w_sizes: each layer's parameter-gradient size (conv weight and bias, BN weight and
            bias), made by its conv backward and held to the end of the chain's backward
            (the Function returns them together); ``None``: not counted.

    Returns:
        ``(peak, layer)``: counting the kept outputs, the incoming gradient (freed once
        consumed) and every buffer the backward creates.
    """
    k = len(y_sizes)
    live: Dict[object, int] = {("y", i): y_sizes[i] for i in range(k) if keep[i]}
    live["g"] = y_sizes[-1]
    state = [sum(live.values()), k - 1, k - 1]  # peak, its layer, current layer

    def alloc(name: object, n: int) -> None:
        live[name] = n
        total = sum(live.values())
        if total > state[0]:
            state[0], state[1] = total, state[2]

    def free(name: object) -> None:
        live.pop(name, None)

    def build_x(i: int) -> None:  # layer i's input from y_{i-1}, live as ("x", i)
        get_y(i - 1)
        if acts[i - 1] == "smooth":
            alloc(("z", i - 1), y_sizes[i - 1])
            alloc(("x", i), x_sizes[i])
            free(("z", i - 1))
        else:
            alloc(("x", i), x_sizes[i])

    def get_y(i: int) -> None:
        if ("y", i) in live:
            return
        if i > 0 and ("x", i) not in live:
            build_x(i)
        alloc(("y", i), y_sizes[i])
        if i > 0 and drop[i]:
            free(("x", i))

    grad: object = "g"
    for i in reversed(range(k)):
        state[2] = i
        get_y(i)
        if acts[i] == "output" and ("x", i + 1) in live:
            free(grad)
            grad = ("x", i + 1)  # grad_z written into the rebuilt output
        elif acts[i] != "identity":
            alloc(("z", i), y_sizes[i])  # recomputed z, overwritten by grad_z
            free(grad)
            grad = ("z", i)
        alloc("gy", y_sizes[i])  # BN backward
        free(grad)
        free(("y", i))
        if i > 0 and ("x", i) not in live:
            build_x(i)
        if w_sizes is not None:
            live[("w", i)] = w_sizes[i]  # grad_weight, with grad_x below
        alloc("gx", x_sizes[i])  # conv backward
        free("gy")
        if i > 0 and acts[i - 1] != "output":
            free(("x", i))
        live["g2"] = live.pop("gx")
        grad = "g2"
    return state[0], state[1]


def choose_drops(
    y_sizes: Sequence[int], x_sizes: Sequence[int], keep: Sequence[bool], acts: Sequence[str]
) -> List[bool]:
    """Which recomputed layers should drop their rebuilt input during BN backward: each
    one, in turn, whose drop lowers the replayed peak (a drop costs one element-wise
    rebuild, so it is taken only where it pays in memory)."""
    k = len(y_sizes)
    drop = [False] * k
    best = replay(y_sizes, x_sizes, keep, acts, drop)[0]
    for i in range(1, k):
        if keep[i]:
            continue
        drop[i] = True
        peak = replay(y_sizes, x_sizes, keep, acts, drop)[0]
        if peak < best:
            best = peak
        else:
            drop[i] = False
    return drop
