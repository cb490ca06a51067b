"""The memory of a chain's backward, replayed on sizes alone.

:func:`replay` walks the layers in the order of :func:`convbn.autograd.chain.chain_backward`
(Note: [chain backward order]) with numbers instead of tensors: kept and recomputed conv
outputs, rebuilt inputs, the incoming gradient, grad_z, grad_y and grad_x, each
allocated and freed where the real backward does. It serves twice: the backward asks
:func:`choose_drops` which rebuilt inputs are worth dropping and rebuilding (an extra
element-wise pass) because that lowers its peak, and the planner
(:func:`convbn.passes.plan.peak_model.chain_backward_peak`) predicts each plan's peak with it.
Pure Python: no tensors, no torch.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["replay", "choose_drops", "ACT_KINDS"]

#: tail kinds: no backward; one activation with its derivative from the output (ReLU
#: family); one activation with its derivative from ``z``; a general tail, written
#: ``"tail:" + one code per op`` (``A`` activation, ``P`` PReLU, ``D`` dropout, ``d``
#: in-place dropout), replayed op by op as autograd/chain_tail.py runs it (Note: [general
#: tail backward]; a dropout's noise as the CPU kernels allocate it).
ACT_KINDS = ("identity", "output", "smooth", "tail:...")


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
        acts: each layer's kind from :data:`ACT_KINDS`.
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
    """
    k = len(y_sizes)

    def needs_y(i: int) -> bool:
        return not (head and i == 0) and not (end and i == k - 1 and acts[i] == "identity")

    live: Dict[object, int] = {("y", i): y_sizes[i] for i in range(k) if keep[i] and needs_y(i)}
    live["g"] = y_sizes[-1]
    for i, n in enumerate(s_sizes or ()):
        if n:
            live[("st", i)] = n
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
        if acts[i - 1].startswith("tail:"):
            n = y_sizes[i - 1]
            alloc(("u", i), n)  # z: every op below runs on a buffer of the tail's own
            for op in acts[i - 1][5:]:
                if op in "PD":  # a new output; a dropout's noise transient
                    if op == "D":
                        alloc("noise", n)
                    alloc(("u2", i), n)
                    free("noise")
                    live[("u", i)] = live.pop(("u2", i))
                elif op == "d":
                    alloc("noise", n)
                    free("noise")
            live[("x", i)] = live.pop(("u", i))
            if x_sizes[i] != n:  # a constant pre-pad copies
                alloc(("x", i), x_sizes[i])
        elif acts[i - 1] == "smooth":
            alloc(("z", i - 1), y_sizes[i - 1])
            alloc(("x", i), x_sizes[i])
            free(("z", i - 1))
        else:
            alloc(("x", i), x_sizes[i])

    def get_y(i: int) -> None:
        if ("y", i) in live or (head and i == 0):
            return
        if i > 0 and ("x", i) not in live:
            build_x(i)
        alloc(("y", i), y_sizes[i])
        if i > 0 and drop[i]:
            free(("x", i))

    def tail_backward(i: int, ops: str, grad: object) -> object:
        """Note: [general tail backward]: rebuild inputs up to the last op that needs one, then
        walk back; returns the name of grad_z. The incoming gradient is freed by the caller."""
        n = y_sizes[i]
        owned = not (end and i == k - 1)  # an end layer's tail reads its conv output itself
        if owned:
            alloc(("u", i, 0), n)  # recomputed z
        last = max((j for j, op in enumerate(ops) if op in "AP"), default=-1)
        cur: object = ("u", i, 0) if owned else ("y", i)
        saved: Dict[int, object] = {}
        for j, op in enumerate(ops):
            if op in "AP":
                saved[j] = cur
            if j >= last:
                break
            nxt = ("u", i, j + 1)
            if op in "APD":
                if op == "D":
                    alloc("noise", n)
                alloc(nxt, n)
                free("noise")
            else:  # in-place dropout: its noise only (a copy first where the buffer is not its own)
                alloc("noise", n)
                free("noise")
                if cur == ("y", i):
                    alloc(nxt, n)
                else:
                    live[nxt] = live.pop(cur)  # type: ignore[arg-type]
            if op in "Dd" and cur != ("y", i) and cur not in saved.values():
                free(cur)
            cur = nxt
        if cur not in saved.values() and cur != ("y", i):
            free(cur)
        g = grad
        for j in reversed(range(len(ops))):
            op = ops[j]
            new: object = ("gt", i, j)
            if op in "Dd":  # the slope regenerated on a buffer of ones
                alloc(("s", i), n)
                if op == "D":
                    alloc("noise", n)
                    alloc(("s2", i), n)
                    free("noise")
                    free(("s", i))
                    live[("s", i)] = live.pop(("s2", i))
                else:
                    alloc("noise", n)
                    free("noise")
                alloc(new, n)
                free(("s", i))
            elif op == "P":
                alloc(new, n)
                alloc("gw", n)  # PReLU's weight gradient before its reduction
                free("gw")
                free(saved[j])
            elif saved[j] == ("y", i):
                alloc(new, n)
            else:  # the derivative written into the consumed input
                live[new] = live.pop(saved[j])  # type: ignore[arg-type]
            if g != grad:
                free(g)
            g = new
        return g

    grad: object = "g"
    for i in reversed(range(k)):
        state[2] = i
        last_end = end and i == k - 1
        if needs_y(i) or (head and i == 0):
            get_y(i)
            if acts[i] == "output" and ("x", i + 1) in live:
                free(grad)
                grad = ("x", i + 1)  # grad_z written into the rebuilt output
            elif acts[i].startswith("tail:"):
                grad = tail_backward(i, acts[i][5:], grad)
            elif acts[i] != "identity":
                alloc(("z", i), y_sizes[i])  # recomputed z, overwritten by grad_z
                free(grad)
                grad = ("z", i)
            if last_end:  # no BN: the tail's gradient goes to the conv
                live["gy"] = live.pop(grad)  # type: ignore[arg-type]
            else:
                alloc("gy", y_sizes[i])  # BN backward
                free(grad)
            free(("y", i))
            if ("st", i) in live:
                free(("st", i))
        else:  # an end layer without tail: the incoming gradient goes to the conv
            live["gy"] = live.pop(grad)  # type: ignore[arg-type]
        if head and i == 0:
            break  # grad_y is the chain input's gradient
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
