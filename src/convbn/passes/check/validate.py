"""Validation shared by :func:`convbn.convert` and :func:`convbn.fold`: run a model with its
state restored exactly afterwards (:class:`StateSnapshot`), run one training step without
touching ``.grad`` (:func:`run_step`), and compare two outputs leaf by leaf
(:func:`compare_outputs`)."""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from ..._compat import pytree

from ...functional.private_rng import PrivateRNG, private_rng
from .backward_aside import backward_grads, holds_reentrant_checkpoint
from .buffer_copies import buffer_copy, close_copies, open_copies
from .plain_state import PlainState
from .upstream import handed_once

__all__ = ["StateSnapshot", "Comparison", "compare_outputs", "run_step", "step_forward", "upstream_gradients", "seeded", "as_args", "float64_slack", "eager_error_slack", "to_float64",
           "tolerance", "tolerance_rule", "ToleranceRule", "TOLERANCES", "CheckKind", "buffers_set_aside", "batch_sample",
           "clone_tensors", "relative_floor", "leaf_difference"]


def as_args(example_inputs: Any, name: str = "example_inputs") -> Tuple[Any, ...]:
    """Sample inputs as positional arguments: the one normalisation that :func:`convbn.convert`,
    :func:`convbn.explain`, :func:`convbn.fold`, :func:`convbn.max_batch` and the command line
    use. A tensor is one argument; a tuple or list is spread, one argument per element (a
    dict, or any other value, is passed as one argument wrapped in a tuple: ``(d,)``).

    Args:
        example_inputs: a ``Tensor``, or a tuple or list of positional arguments.
        name: the argument's name in the caller's signature, for the error.

    Returns:
        The positional arguments, as a tuple.

    Raises:
        TypeError: anything else (``None`` included: callers decide what no inputs mean
            before asking), naming the value and what is accepted.

    Example:
        >>> as_args(torch.zeros(2, 3))[0].shape
        torch.Size([2, 3])
        >>> as_args([1, 2])
        (1, 2)
    """
    if isinstance(example_inputs, Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    if isinstance(example_inputs, dict):
        got = f"a dict with keys {list(example_inputs)[:8]}"
    else:
        text = repr(example_inputs)
        got = f"{type(example_inputs).__name__} {text[:60] + '...' if len(text) > 60 else text}"
    raise TypeError(f"{name} must be a Tensor, or a tuple or list of positional arguments (one dict or other "
                    f"value as one argument: {name}=(value,)), but got {got}")


# Note: [one tolerance rule]
# A rewrite (convert's chains, fold's folded weights) only reorders rounding. Every check that
# compares a rewrite with eager -- convert's first-call and first-backward checks, the
# whole-model step check (check/step.py), fold's check (fold/fold_check.py) and its float64
# verdict -- passes a floating leaf when
#     max|new - eager| <= rule(dtype) * scale + rule.eager_error_factor * (eager's own distance
#                                                to a float64 run of the same step),
# the second term asked for only when the first alone fails (Note: [fold's tolerance follows
# eager's own rounding] in fold_check.py); where both fail, convert's step check asks whether the
# rewrite equals eager in float64 (Note: [a float32 difference decided in float64] in step.py). ``scale`` is :func:`compare_outputs`'. The numbers
# live here and nowhere else, in one row per kind of check, read when a check runs:
# ``"step"`` for a training step (forward and backward, gradients relative to their own
# size: convert's checks), ``"fold"`` for an inference forward (folding is exact algebra on
# eval-mode statistics: a tighter relative term).


@dataclass(frozen=True)
class ToleranceRule:
    """The allowance of one kind of check (Note: [one tolerance rule]).

    Attributes:
        relative: the relative term per dtype.
        other_dtypes: the relative term for every dtype not in ``relative`` (half, bfloat16...).
        eager_error_factor: the multiple of eager's own distance to a float64 run allowed on top.

    Example:
        >>> tolerance_rule("fold")(torch.float32)
        0.0001
    """

    relative: Mapping[torch.dtype, float]
    other_dtypes: float
    eager_error_factor: float = 4.0

    def __call__(self, dtype: torch.dtype) -> float:
        return self.relative.get(dtype, self.other_dtypes)


#: the kinds of check a :class:`ToleranceRule` exists for
CheckKind = Literal["step", "fold"]

#: the one table of tolerances, a row per kind of check
TOLERANCES: Dict[str, ToleranceRule] = {
    "step": ToleranceRule({torch.float64: 1e-7, torch.float32: 1e-3}, 5e-2),
    "fold": ToleranceRule({torch.float64: 1e-10, torch.float32: 1e-4}, 1e-2),
}


def tolerance_rule(check: CheckKind = "step") -> ToleranceRule:
    """The :class:`ToleranceRule` of a ``check`` (``"step"`` or ``"fold"``), read from
    :data:`TOLERANCES` when asked.

    Raises:
        ValueError: ``check`` is not a row of :data:`TOLERANCES`.
    """
    if check not in TOLERANCES:
        raise ValueError(f"check must be one of {tuple(TOLERANCES)}, but got check={check!r}")
    return TOLERANCES[check]


def tolerance(dtype: torch.dtype, check: CheckKind = "step") -> float:
    """The relative tolerance of a ``check`` for ``dtype`` (Note: [one tolerance rule])."""
    return tolerance_rule(check)(dtype)


def _cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (so its RNG states exist and may move).

    Not ``torch.cuda.is_available()``: reading the RNG state initialises CUDA, which raises in
    a forked worker (DDP's fork / notebook start methods) and costs a context elsewhere; a
    process that has not initialised CUDA has no CUDA tensor a model could draw numbers for.
    """
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class StateSnapshot:
    """Snapshot buffers and ``training`` flags of ``model``, and its modules' plain attributes and
    buffer bindings (Note: [a check's run leaves the model's plain state as it was]); put them
    back on exit. Random
    numbers drawn in the block come from generators of its own (:func:`seeded` with seed 0,
    unless an inner :func:`seeded` block says otherwise): the global RNG streams, and what
    other threads draw from them, are not touched.

    Example:
        >>> with StateSnapshot(model):
        ...     model(x)   # running statistics, num_batches_tracked, RNG: unchanged afterwards
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> "StateSnapshot":
        # an enclosing snapshot's copy where it still holds the buffer's bits (Note: [nested snapshots share their copies])
        self.copies = {id(b): (b, buffer_copy(b)) for b in self.model.buffers()}
        self.offered = open_copies(self.copies)  # the same dict: a copy lent is lent from here too
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.plain = PlainState(self.model)
        self.rng = seeded(0)
        self.rng.__enter__()
        return self

    @property
    def buffers(self) -> List[Tuple[Tensor, Tensor]]:
        """``(buffer, copy)`` pairs held now (a copy lent is not held: Note: [copies lent while a
        step cannot write them] in buffer_copies.py)."""
        return list(self.copies.values())

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(None, None, None)
        close_copies(self.offered)
        self.plain.restore()
        with torch.no_grad():
            for b, v in self.copies.values():
                if not b.is_inference():
                    b.copy_(v)
        for m, t in self.modes:
            m.training = t


def seeded(seed: int) -> ContextManager[PrivateRNG]:
    """Random numbers drawn in the block, in this thread, come from generators of the block's
    own seeded with ``seed``; the global streams are untouched (Note: [a check's random
    numbers are its own] in ``functional/private_rng.py``)."""
    return private_rng(seed)


@dataclass
class Comparison:
    """Result of :func:`compare_outputs`: ``ok``, the worst difference and its allowance, and why not."""

    ok: bool
    max_abs_diff: float = 0.0
    allowed: float = 0.0
    note: str = ""

    def describe(self) -> str:
        if self.note:
            return self.note
        return f"max |difference| {self.max_abs_diff:.3g} > allowed {self.allowed:.3g}"


def _strided(t: Any) -> Any:
    """A sparse (or other non-strided) tensor as a dense one, for comparing (a sparse parameter's
    gradient is sparse; ``max`` and subtraction of its values are not defined for every layout)."""
    return t.to_dense() if isinstance(t, Tensor) and t.layout != torch.strided else t


def relative_floor(reference: Any) -> float:
    """The smallest scale :func:`compare_outputs` gives a leaf with ``relative``: 1e-3 of the
    largest finite ``max|leaf|`` of ``reference`` (read without a copy of any leaf)."""
    mags = [_abs_max(t) for t in pytree.tree_leaves(reference)
            if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
    return 1e-3 * max((m for m in mags if math.isfinite(m)), default=0.0)


def _abs_max(t: Tensor) -> float:
    t = _strided(t.detach())
    return max(abs(t.amax().item()), abs(t.amin().item()))


#: elements of a leaf compared at a time: a check's float64 working copies stay ~1.5 MiB (Note: [a
#: check's comparison in bounded memory])
_CHUNK = 1 << 16


def _chunks(t: Tensor) -> Iterator[Tensor]:
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        yield flat[start:start + _CHUNK]


def leaf_difference(a: Tensor, b: Tensor) -> Tuple[Optional[str], float, float]:
    """``(why they differ beyond rounding or None, max|a - b|, max|a|)`` over the finite values of
    two floating tensors of one shape (non-finite values must be the same, in the same places;
    a difference of -1: no value is finite).

    # Note: [a check's comparison in bounded memory]
    # The difference is taken in float64 a chunk of :data:`_CHUNK` elements at a time: whole-leaf
    # float64 copies of the largest gradient (three of them, twice a float32 leaf's bytes each)
    # were the peak of ``convert``'s check on weight-heavy models, above a training step's."""
    diff = scale = 0.0
    any_finite = False
    a, b = _strided(a), _strided(b)
    diffs: List[Tensor] = []  # per chunk of finite values alone (the common case): read once at the end
    scales: List[Tensor] = []
    for ac, bc in zip(_chunks(a), _chunks(b)):
        if not ac.is_complex() and ac.numel() and bool(torch.isfinite(ac).all()) and bool(torch.isfinite(bc).all()):
            diffs.append((ac.double() - bc.double()).abs().max())
            scales.append(ac.abs().max())  # exact in the leaf's own dtype
            continue
        fa = torch.isfinite(ac)
        if not torch.equal(fa, torch.isfinite(bc)) or not torch.equal(ac[~fa].nan_to_num(), bc[~fa].nan_to_num()):
            return "non-finite values appeared, disappeared or changed", math.inf, 0.0
        if not fa.any():
            continue
        any_finite = True
        every = bool(fa.all())
        a64, b64 = (ac if every else ac[fa]).double(), (bc if every else bc[fa]).double()
        diff = max(diff, (a64 - b64).abs().max().item())
        scale = max(scale, a64.abs().max().item())
    if diffs:
        any_finite = True
        diff = max(diff, torch.stack(diffs).max().item())
        scale = max(scale, float(torch.stack(scales).max().item()))
    return (None, diff, scale) if any_finite else (None, -1.0, 0.0)


def compare_outputs(reference: Any, candidate: Any, tolerance: Callable[[torch.dtype], float],
                    slack: Optional[Sequence[float]] = None, relative: bool = False,
                    floor: Optional[float] = None) -> Comparison:
    """Compare two pytrees of outputs leaf by leaf.

    A floating tensor passes when ``max|candidate - reference| <= tol * scale + slack[i]``
    (``tol = tolerance(dtype)``, ``slack`` per floating leaf, default 0), with the same
    non-finite values. ``scale`` is ``max(1, max|reference|)``, or with ``relative`` the
    leaf's own ``max|reference|`` but at least ``floor`` (default :func:`relative_floor` of
    ``reference``: 1e-3 of the largest leaf's; gradients are often far below 1). Other tensors
    must be equal, other values equal.
    """
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    ref_leaves = [_strided(t) for t in ref_leaves]
    if relative and floor is None:
        floor = relative_floor(ref_leaves)
    new_leaves, new_spec = pytree.tree_flatten(candidate)
    new_leaves = [_strided(t) for t in new_leaves]
    if ref_spec != new_spec:
        return Comparison(False, math.inf, 0.0, f"output structure changed: {ref_spec} vs {new_spec}")
    worst = Comparison(True)
    worst_ratio = -1.0
    k = 0
    for a, b in zip(ref_leaves, new_leaves):
        if not isinstance(a, Tensor):
            if isinstance(b, Tensor) or (a != b and not (a is b)):
                return Comparison(False, math.inf, 0.0, "a non-tensor output changed")
            continue
        if not isinstance(b, Tensor) or a.shape != b.shape:
            return Comparison(False, math.inf, 0.0, f"an output tensor changed shape: {tuple(a.shape)} vs "
                              f"{tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__}")
        if not a.is_floating_point() and not a.is_complex():
            if not torch.equal(a, b):
                return Comparison(False, math.inf, 0.0, "a non-floating output changed")
            continue
        extra = slack[k] if slack is not None and k < len(slack) else 0.0
        k += 1
        if torch.equal(a, b):  # the common case (bit-identical): nothing to measure
            continue
        note, diff, amax = leaf_difference(a, b)
        if note is not None:
            return Comparison(False, math.inf, 0.0, note)
        if diff < 0:  # nothing finite, and the non-finite values agree
            continue
        scale = max(floor or 0.0, amax) if relative else max(1.0, amax)
        allowed = tolerance(a.dtype) * scale + extra
        ratio = diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = Comparison(ratio <= 1.0, diff, allowed)
    return worst


def run_step(model: nn.Module, args: Tuple[Any, ...], params: Sequence[Tensor], seed: int,
             backward: bool = True, rng: Optional[List[Tensor]] = None, grad_inputs: bool = True,
             on_grad: Optional[Callable[[int, Tensor], None]] = None) -> Tuple[Any, List[Optional[Tensor]]]:
    """One forward (RNG seeded with ``seed``) and, where possible, one backward with a random
    upstream gradient (also from ``seed``), returning outputs and the gradients of ``params``
    and of the floating tensor inputs. ``.grad`` fields are left alone (``torch.autograd.grad``;
    through a reentrant checkpoint, ``.backward()`` with every ``.grad`` set aside and restored:
    ``check/backward_aside.py``);
    the caller restores state (:class:`StateSnapshot`). ``rng``: a list to which the states of
    the forward's and the backward's private generators afterwards are appended (what each drew).
    ``grad_inputs=False``: the inputs require grad only where the caller's did (a model that
    sets ``requires_grad`` on a view of its input runs only so), and their gradients are
    compared only then. ``on_grad``: the backward is the training loop's own (``.backward()``,
    every ``.grad`` set aside and restored), each gradient handed to ``on_grad(i, grad)`` as
    soon as it is accumulated and released (its slot ``None``): Note: [a check that holds one
    side's gradients] in step.py."""
    out, outs, wrt = step_forward(model, args, params, seed, rng, grad_inputs)
    if not backward or not outs or not wrt or not torch.is_grad_enabled():
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out), []
    ups = upstream_gradients(outs, seed)
    ups, handles = handed_once(outs, ups)  # Note: [an upstream gradient let go once used]
    try:
        with seeded(seed + 2) as drawn:  # a backward drawing random numbers draws the same on both sides
            if on_grad is not None:
                grads = backward_grads(outs, wrt, ups, params, on_grad=on_grad)
            elif holds_reentrant_checkpoint(outs):  # refuses autograd.grad: Note [a check's backward through a reentrant checkpoint]
                grads = backward_grads(outs, wrt, ups, params)
            else:
                grads = torch.autograd.grad(outs, wrt, ups, allow_unused=True)
            if rng is not None:
                rng.extend(drawn.states())
    finally:
        for h in handles:
            h.remove()
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out), list(grads)


def step_forward(model: nn.Module, args: Tuple[Any, ...], params: Sequence[Tensor], seed: int,
                 rng: Optional[List[Tensor]] = None, grad_inputs: bool = True) -> Tuple[Any, List[Tensor], List[Tensor]]:
    """The forward of :func:`run_step` (same arguments): its outputs, the outputs that require
    grad, and the tensors differentiated (``params`` that require grad, then the inputs that do).

    Raises:
        RuntimeError: the model wrote into an input that requires grad under ``no_grad``."""
    inputs = [_step_input(a, grad_inputs) if isinstance(a, Tensor) else a for a in pytree.tree_leaves(args)]
    versions = [(a, a._version) for a in inputs if isinstance(a, Tensor) and a.requires_grad]
    leaves, spec = pytree.tree_flatten(args)
    it = iter(inputs)
    call_args = pytree.tree_unflatten([next(it) for _ in leaves], spec)
    with seeded(seed) as drawn:
        out = model(*call_args)
        if rng is not None:
            rng.extend(drawn.states())
    if any(a._version != v for a, v in versions):  # written in place under no_grad: the caller's tensor
        raise RuntimeError("the model wrote into its input in place; run again on copies")
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.requires_grad]
    wrt = [p for p in params if p.requires_grad] + [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    return out, outs, wrt


def upstream_gradients(outs: Sequence[Tensor], seed: int) -> List[Tensor]:
    """The random upstream gradient of each of a step's outputs (:func:`run_step`), drawn from ``seed + 1``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]


def _step_input(a: Tensor, grad_inputs: bool) -> Tensor:
    """A check's own input for one step. Note: [a check's inputs are aliases where autograd guards them]
    An input made to require grad is a detached *alias* of the caller's tensor, not a copy: a
    leaf that requires grad cannot be written in place with grad enabled (autograd raises, and
    :func:`convbn.passes.check.step.check_step` runs again with ``grad_inputs=False``), and a
    write under ``no_grad`` moves its version counter, which :func:`run_step` checks. A copy
    would be one more input's bytes alive through both steps of the check, above eager's step.
    Every other input is a copy (the model may write into it)."""
    needs = a.is_floating_point() and (grad_inputs or a.requires_grad)
    return a.detach().requires_grad_(True) if needs else a.detach().clone()


def to_float64(tree: Any) -> Any:
    """``tree`` with every floating tensor converted to float64 (the rest as it is)."""
    return pytree.tree_map(lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t, tree)


def float64_slack(model: nn.Module, run: Callable[[nn.Module], Any], reference: Any,
                  factor: Optional[float] = None) -> Optional[List[float]]:
    """``factor`` (default: the ``"step"`` rule's ``eager_error_factor``) times what ``reference``
    (``run(model)``'s result in the model's dtype) gets wrong against ``run`` of a float64 copy,
    per floating leaf: the slack a comparison of two float32 computations needs where rounding
    is amplified (the second term of Note: [one tolerance rule]). ``None`` where everything is
    float64 already or no float64 copy can be made or run."""
    if factor is None:
        factor = tolerance_rule("step").eager_error_factor
    leaves = [t for t in pytree.tree_leaves(reference) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float64 for t in leaves):
        return None
    try:
        model64 = copy.deepcopy(model).double()
        with StateSnapshot(model64):
            exact = run(model64)
    except Exception:  # noqa: BLE001 - no float64 reference: the caller's tolerance alone
        return None
    return eager_error_slack(reference, exact, factor)


def eager_error_slack(reference: Any, exact: Any, factor: Optional[float] = None) -> Optional[List[float]]:
    """``factor`` (default: the ``"step"`` rule's ``eager_error_factor``) times ``max|reference -
    exact|`` per floating leaf over the values finite in both (``exact``: the same run in float64),
    taken a chunk at a time (Note: [a check's comparison in bounded memory]); ``None`` where the
    two trees' floating leaves differ in number."""
    if factor is None:
        factor = tolerance_rule("step").eager_error_factor
    leaves = [t for t in pytree.tree_leaves(reference) if isinstance(t, Tensor) and t.is_floating_point()]
    exact_leaves = [t for t in pytree.tree_leaves(exact) if isinstance(t, Tensor) and t.is_floating_point()]
    if len(exact_leaves) != len(leaves):
        return None
    slack = []
    for a, e in zip(leaves, exact_leaves):
        err = 0.0
        if a.shape == e.shape:
            for ac, ec in zip(_chunks(_strided(a)), _chunks(_strided(e))):
                finite = torch.isfinite(ac) & torch.isfinite(ec)
                if finite.any():
                    err = max(err, (ac.double() - ec.double())[finite].abs().max().item())
        slack.append(factor * err)
    return slack


@contextlib.contextmanager
def buffers_set_aside(module: nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` replaced by a copy for the block, the originals put back after
    (untouched: not even their version counters move)."""
    held = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    for m, name, b in held:
        m._buffers[name] = b.detach().clone()
    try:
        yield
    finally:
        for m, name, b in held:
            m._buffers[name] = b


def batch_sample(tree: Any, n: int = 2) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Detached copies of ``(args, kwargs)`` cut to their first ``n`` samples (every tensor whose
    first dimension is the batch's, read off the first tensor); ``None`` for a batch of one
    (BatchNorm in training needs two values per channel)."""
    leaves = [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]
    if not leaves or leaves[0].dim() == 0 or leaves[0].shape[0] < 2:
        return None
    batch = leaves[0].shape[0]
    return pytree.tree_map(
        lambda t: (t[:n] if t.dim() and t.shape[0] == batch else t).detach().clone() if isinstance(t, Tensor) else t,
        tree)


def clone_tensors(tree: Any) -> Any:
    """``tree`` with every tensor cloned (a check's own copy of a call's inputs)."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, tree)
