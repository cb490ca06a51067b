"""convbn on the torch releases it declares: ``convbn._compat``'s fallbacks, and a tracer that
fails on every model says so (Note: [a tracer that fails everywhere says so]).

The fallbacks are the paths an older or newer torch takes; each is run here on this torch by
making the feature check answer as that release would, and compared with the path this torch
takes. ``scripts/test_torch.sh VERSION`` runs the ``compat`` subset on the real releases.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import convbn
from convbn import _compat
from convbn.passes.graph import share_copy as share_copy_module
from convbn.passes.graph import thread_patch
from convbn.passes.tracing import self_check


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())


def _tracer_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracer as torch 2.15 broke it (torch.fx's module-global tracing flag gone)."""
    def missing() -> Any:
        raise AttributeError("module 'torch.fx._symbolic_trace' has no attribute '_is_fx_tracing_flag'")

    monkeypatch.setattr(thread_patch, "fx_tracing_flag", missing)
    monkeypatch.setattr(self_check, "_WORKS", [])


@pytest.mark.expect_unfused("the tracer is broken on purpose: nothing can fuse, and convert must say so")
def test_a_tracer_that_fails_on_every_model_warns_in_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    _tracer_broken(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"convbn.convert cannot trace even nn.Sequential.*torch >= 2.8"):
        fast = convbn.convert(_model())
    assert len(fast.convbn_report.pairs) == 0 and fast.convbn_report.untraced


def test_a_tracer_that_fails_on_every_model_warns_in_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    _tracer_broken(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"convbn.fold cannot trace even nn.Sequential.*_is_fx_tracing_flag"):
        convbn.fold(_model().eval())


class _DataDependent(nn.Module):
    """A user's module whose own code does not trace (Python branches on a value)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if x.sum() > -1e9 else x


def test_a_user_module_that_does_not_trace_is_no_alarm() -> None:
    self_check._WORKS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fast = convbn.convert(_DataDependent())
    assert fast.convbn_report.untraced and len(fast.convbn_report.pairs) == 2
    assert self_check.tracer_failure() is None


def test_the_fx_tracing_flag_where_torch_keeps_it_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """2.15 on: no module-global flag, nothing to save or restore (torch.fx of this torch still
    needs its own, so only the compat functions run without it; the 2.15 run of the compat
    subset traces for real)."""
    monkeypatch.delitem(_compat.fx_trace_globals(), "_is_fx_tracing_flag", raising=False)
    assert _compat.fx_tracing_flag() is None
    _compat.set_fx_tracing_flag(None)
    assert "_is_fx_tracing_flag" not in _compat.fx_trace_globals()


def test_function_apply_as_a_classmethod_or_a_plain_function() -> None:
    """Up to 2.14 ``Function.apply`` is a classmethod; from 2.15 a plain function on the class."""
    def impl(cls: type, *args: Any) -> Any:
        return (cls, args)

    for stored in (classmethod(impl), impl):
        got = _compat.function_apply_impl(stored)
        assert got is impl
        holder = type("Holder", (), {"apply": _compat.function_apply_wrapper(got)})
        assert holder.apply(1, 2) == (holder, (1, 2))
    with pytest.raises(TypeError, match="expected a classmethod"):
        _compat.function_apply_impl(3)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 4),
    lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
    lambda: torch.randn(4, 6)[:, ::2],
    lambda: torch.randn(3, 1).expand(3, 4),
    lambda: torch.randn(2, 3, 4, 5).permute(3, 1, 0, 2),
    lambda: torch.randn(2, 1, 4)[:, :, 1:],
    lambda: torch.randn(0, 3),
    lambda: torch.randn(3, 0),
    lambda: torch.randn(7)[::2],
    lambda: torch.randn(1, 1),
    lambda: torch.randn(6).as_strided((2, 1, 3), (3, 100, 1)),  # a size-1 dimension's stride is free
    lambda: torch.randn(5, 1, 3).transpose(0, 1),
])
def test_the_dense_check_fallback_agrees_with_torch(make: Any) -> None:
    """Before 2.9 torch has no ``is_non_overlapping_and_dense_or_false``: the fallback, against
    torch's own answer where this torch has it."""
    prims = pytest.importorskip("torch._prims_common")
    if not hasattr(prims, "is_non_overlapping_and_dense_or_false"):
        pytest.skip("this torch has no is_non_overlapping_and_dense_or_false: the fallback is what runs")
    t = make()
    assert _compat.dense_or_false_fallback(t) == prims.is_non_overlapping_and_dense_or_false(t)


def test_fsdp_copy_without_torchs_switch_keeps_class_and_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 2.9 there is no ``disable_fsdp_module_new_init``: the copy is made without ``__new__``."""
    class Refuses(nn.Module):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # as FSDP's FSDP<Module> classes would
            raise AssertionError("a copy must not construct the class")

    module = object.__new__(Refuses)
    nn.Module.__init__(module)
    module.conv = nn.Conv2d(1, 1, 1)
    monkeypatch.setattr(share_copy_module, "fsdp_new_init_disabled", lambda: None)
    clone = share_copy_module._copy_fsdp_module(module)
    assert type(clone) is Refuses and clone is not module
    assert clone.conv is module.conv and clone._modules is not None


def test_global_module_hooks_are_seen() -> None:
    from convbn.passes.graph.hooks import hook_reason  # noqa: F401 - the reader of global_module_hooks

    assert not any(_compat.global_module_hooks())
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert any(_compat.global_module_hooks())
    finally:
        handle.remove()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="a torch built without distributed")
def test_mem_tracker_is_found_by_feature() -> None:
    assert _compat.HAS_MEM_TRACKER
    assert _compat.mem_tracker_class().__name__ == "MemTracker"


@pytest.mark.parametrize("args", [[], ["2.x"], ["2.8.0", "--constraint"], ["2.8.0", "--constraint", "/no/such/file"]])
def test_test_torch_script_refuses_bad_arguments_in_one_line(args: list) -> None:
    """``scripts/test_torch.sh`` checks its arguments before it builds anything: exit 2, one line."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "test_torch.sh"
    done = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "CONVBN_TORCH_VENVS": "/nonexistent/never-made"})
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == "", done
