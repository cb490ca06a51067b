"""The fusion watch: makes "convbn silently stopped fusing" a test failure (issue 23).

``tests/conftest.py`` installs it once per test process and wraps every test body in
:func:`watching`. While a test runs it records, without changing anything convbn does:

* every model ``convbn.convert`` returns (``convbn.convert`` and
  ``convbn.passes.convert.api.convert`` are replaced by a pass-through that keeps the result);
* every ``FusedChain`` call, and whether it ran fused: an output autograd records must come
  from the fused Function (``ChainFunctionBackward``), one it does not (no grad) from the
  chain's no-grad kernel (``chain_forward_no_grad``, counted by a pass-through wrapper),
  not from the chain's eager modules.

After the test body passed, :meth:`Watch.check` fails it when a converted model fused
nothing, or a chain call ran unfused. No module hook is registered (``convert`` and the
chain would see hooks and change course), and under ``torch.compile`` the watch steps
aside (the compiled path is an opaque custom op, checked by its own tests). Calls the chain
runs as eager modules by design (:func:`eager_by_design`: hooks added after conversion, an
empty batch ...) are not counted.

A test whose point is an unfused model -- ``convert`` leaving everything alone, hooks
registered after conversion, a zero-size batch -- says so with
``@pytest.mark.expect_unfused("why")`` and is not checked.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

#: the grad_fn name of the fused chain's autograd Function
CHAIN_BACKWARD = "ChainFunctionBackward"
#: the grad_fn name of the per-sample-norm chain's Function (autograd/norm_chain.py)
NORM_CHAIN_BACKWARD = "NormChainFunctionBackward"
#: every fused chain Function's grad_fn name
FUSED_BACKWARDS = (CHAIN_BACKWARD, NORM_CHAIN_BACKWARD)

__all__ = ["CHAIN_BACKWARD", "NORM_CHAIN_BACKWARD", "FUSED_BACKWARDS", "Watch", "install", "start", "stop", "watching", "current"]


@dataclass
class _ChainCalls:
    name: str  # the chain's layers, read at its first call (the watch keeps no module alive)
    calls: int = 0
    fused: int = 0  # of those, run by the fused Function or the no-grad kernel
    unfused_how: str = ""


@dataclass
class Watch:
    """What one test converted and ran (see the module docstring)."""

    # (model, why it fused nothing or None, its class name): a weak reference and strings only
    # (the report names modules), so that a test of what convert leaves alive is not defeated
    # by the watch itself
    converted: List[Tuple["weakref.ref[nn.Module]", Optional[str], str]] = field(default_factory=list)
    chains: Dict[int, _ChainCalls] = field(default_factory=dict)

    def chain_call(self, chain: nn.Module, out: Any, no_grad_kernel: bool, by_design: bool) -> None:
        if not isinstance(out, Tensor) or by_design:
            return
        rec = self.chains.get(id(chain))
        if rec is None:
            name = " -> ".join(n for l in chain.layers for n in l.names[:2] if n)
            rec = self.chains[id(chain)] = _ChainCalls(name)
        rec.calls += 1
        if out.requires_grad:
            name = type(out.grad_fn).__name__
            if name in FUSED_BACKWARDS:
                rec.fused += 1
            else:
                rec.unfused_how = f"output grad_fn {name}, not one of {FUSED_BACKWARDS}"
        elif no_grad_kernel:
            rec.fused += 1
        else:
            rec.unfused_how = "a call without grad did not run the no-grad kernel"

    def problems(self) -> List[str]:
        out = []
        for ref, nothing_fused, cls in self.converted:
            model = ref()
            if model is not None:  # judged as it is now: a module captured on its first call fuses then
                nothing_fused = _nothing_fused(getattr(model, "convbn_report", None))
            if nothing_fused is not None:
                out.append(f"convbn.convert({cls}) fused nothing ({nothing_fused})")
        for rec in self.chains.values():
            if rec.fused < rec.calls:
                where = rec.name
                out.append(f"FusedChain {where!r} ran {rec.calls - rec.fused} of {rec.calls} calls as eager "
                           f"modules ({rec.unfused_how})")
        return out

    def check(self) -> None:
        """Fail the running test if anything it converted or ran was not fused."""
        found = self.problems()
        if found:
            pytest.fail(
                "fusion watch (tests/fusion_watch.py): this test passed but convbn did not fuse:\n  - "
                + "\n  - ".join(found)
                + "\nIf the test is about an unfused model (nothing to fuse, hooks added after convert, "
                  "an eager fallback), mark it @pytest.mark.expect_unfused(\"why\"); otherwise convbn regressed.",
                pytrace=False,
            )


def _nothing_fused(report: Any) -> Optional[str]:
    """Why ``convert`` fused nothing (its first skipped BatchNorms), or ``None`` if it fused something."""
    if report is None or report.pairs:
        return None
    return "; ".join(f"{s.batchnorm}: {s.reason}" for s in report.skipped[:3]) or "no Conv -> norm found"


_CURRENT: List[Optional[Watch]] = [None]


def eager_by_design(chain: Any, inputs: Tuple[Tensor, ...]) -> bool:
    """Whether the chain runs this call as eager modules by design (``FusedChain.forward``'s
    documented fallbacks, read from the chain before the call): hooks on its modules, an empty
    input, a linear layer on an input other than ``(N, C)``, a head chain under autocast.
    Such calls are not counted; every other call must run fused."""
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        return False
    x = inputs[0]
    if getattr(chain, "eager", False):  # auto measured the fused step above eager's (report.eager_fallback)
        return True
    if chain._hooked() or any(t.numel() == 0 for t in inputs) or chain._linear_on_other_shape(x):
        return True
    autocast = torch.is_autocast_enabled(x.device.type)
    # a BatchNorm head chain runs autocast's casts as eager modules (nn/chain.py); a per-sample-norm
    # chain runs fused under autocast, its head included (Note: [a norm chain under autocast])
    return bool(autocast and chain.layers[0].is_head and type(chain).__name__ != "FusedNormChain")


def current() -> Optional[Watch]:
    """The watch of the running test (``None`` outside a test body)."""
    return _CURRENT[0]


def start() -> Watch:
    """Start recording for the running test (see :func:`watching`)."""
    w = Watch()
    _CURRENT[0] = w
    return w


def stop() -> None:
    """Stop recording."""
    _CURRENT[0] = None


@contextlib.contextmanager
def watching() -> Iterator[Watch]:
    """Record conversions and chain calls for the duration of the block."""
    before = _CURRENT[0]
    w = Watch()
    _CURRENT[0] = w
    try:
        yield w
    finally:
        _CURRENT[0] = before


_INSTALLED: List[bool] = []
_NO_GRAD_RUNS = [0]  # calls of the chain's no-grad kernel in this process


def install() -> None:
    """Wrap ``convbn.convert`` and ``FusedChain.forward`` with pass-through recorders (once)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    import convbn
    import convbn.passes.convert.api as convert_mod
    import convbn.autograd.chain_run as chain_run
    from convbn.nn.chain import FusedChain

    convert = convert_mod.convert

    @functools.wraps(convert)
    def recording_convert(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        out = convert(model, *args, **kwargs)
        w = _CURRENT[0]
        if w is not None:
            w.converted.append((weakref.ref(out), _nothing_fused(getattr(out, "convbn_report", None)), type(out).__name__))
        return out

    convert_mod.convert = recording_convert
    convbn.convert = recording_convert

    no_grad = chain_run.chain_forward_no_grad

    @functools.wraps(no_grad)
    def counting_no_grad(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _NO_GRAD_RUNS[0] += 1
        return no_grad(*args, **kwargs)

    chain_run.chain_forward_no_grad = counting_no_grad
    import convbn.autograd.norm_chain as norm_chain

    norm_no_grad = norm_chain.norm_chain_forward_no_grad

    @functools.wraps(norm_no_grad)
    def counting_norm_no_grad(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _NO_GRAD_RUNS[0] += 1
        return norm_no_grad(*args, **kwargs)

    norm_chain.norm_chain_forward_no_grad = counting_norm_no_grad
    forward = FusedChain.forward

    @functools.wraps(forward)
    def recording_forward(self: nn.Module, *inputs: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return forward(self, *inputs)
        w = _CURRENT[0]
        by_design = w is not None and eager_by_design(self, inputs)
        before, was_eager = _NO_GRAD_RUNS[0], getattr(self, "eager", False)
        out = forward(self, *inputs)
        # the chain's first training call measured its fused step above eager's (a weight-heavy
        # chain converted without example_inputs): eager modules from this call on, by design
        by_design = by_design or (getattr(self, "eager", False) and not was_eager)
        if w is not None:
            w.chain_call(self, out, _NO_GRAD_RUNS[0] > before, by_design)
        return out

    FusedChain.forward = recording_forward  # type: ignore[method-assign]


def unwrapped() -> Tuple[Any, Any]:
    """``(convert, FusedChain.forward)`` as convbn defines them (for tests of the watch itself)."""
    import convbn.passes.convert.api as convert_mod
    from convbn.nn.chain import FusedChain

    return getattr(convert_mod.convert, "__wrapped__", convert_mod.convert), \
        getattr(FusedChain.forward, "__wrapped__", FusedChain.forward)
