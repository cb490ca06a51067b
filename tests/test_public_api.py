"""The public API spells each concept once: the names exported, their types, the old names kept
for one release (each warns, naming the new one), and the scoped switches."""
from __future__ import annotations

import argparse
import importlib
import threading
import typing
import warnings
from typing import Any, Callable, Dict, List, Tuple, TypeVar

import pytest
import torch
from torch import nn

import convbn
from convbn.autograd import chain_compiled, chain_kernels

#: Every public module and what it exports. A new name fails here: add it only where it names
#: a concept no other exported name does (test_no_object_exported_under_two_names checks it).
PUBLIC: Dict[str, List[str]] = {
    "convbn": [
        "ACTIVATIONS", "Activation", "BNOutcome", "BatchFit", "ConvertPlan", "ConvertReport", "ConvertStrategy",
        "FoldReport",
        "FusedChain", "FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "GradcheckReport", "PeakMemory",
        "SavedBytes", "Strategy", "Timeline", "compile_chains", "conv_bn_act", "convert", "explain", "fold",
        "fold_conv_bn_modules", "fused_kernels", "fused_modules", "gradcheck_module", "max_batch", "peak_memory",
        "saved_bytes", "tensor_peak", "timeline", "track_saved",
    ],
    "convbn.autograd": ["ChainFunction", "FrozenFunction", "conv_bn_act"],
    "convbn.nn": ["ChainLayer", "FusedChain", "FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "FusedConvGroupNorm1d",
                  "FusedConvGroupNorm2d", "FusedConvGroupNorm3d", "FusedConvInstanceNorm1d", "FusedConvInstanceNorm2d",
                  "FusedConvInstanceNorm3d", "FusedNormChain", "SyncBatchNorm"],
    "convbn.memory": ["PHASES", "PeakMemory", "SavedBytes", "Timeline", "TimelinePoint", "allocator_peak",
                      "format_bytes", "peak_memory", "saved_bytes", "tensor_peak", "timeline", "track_saved"],
    "convbn.integrations": ["convert_submodules", "has_batchnorm"],
    "convbn.reference": ["BatchNorm2dFunction", "Conv2dFunction", "Linear", "LinearFunction",
                         "TutorialFusedConvBN2d", "TutorialFusedConvBN2dFunction"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_listed(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module]), "a public name was added or removed: update PUBLIC"
    for name in mod.__all__:
        getattr(mod, name)  # every listed name resolves, without a warning (the test run errors on one below)


def test_no_object_exported_under_two_names() -> None:
    names: Dict[int, set] = {}
    for module, exported in PUBLIC.items():
        mod = importlib.import_module(module)
        for name in exported:
            obj = getattr(mod, name)
            if isinstance(obj, (str, int, float, tuple)) and not typing.get_origin(obj):
                continue  # plain values (PHASES) are not concepts with identities
            names.setdefault(id(obj), set()).add(name)
    twice = [sorted(n) for n in names.values() if len(n) > 1]
    assert not twice, f"one object exported under several names: {twice}"


def test_current_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module, exported in PUBLIC.items():
            mod = importlib.import_module(module)
            for name in exported:
                getattr(mod, name)


@pytest.mark.parametrize("module", ["convbn.autograd", "convbn.reference"])
def test_what_is_called_a_function_is_an_autograd_function(module: str) -> None:
    mod = importlib.import_module(module)
    for name in mod.__all__:
        if name.endswith("Function"):
            assert issubclass(getattr(mod, name), torch.autograd.Function), name


def test_strategies_are_literal_types() -> None:
    assert typing.get_origin(convbn.Strategy) is typing.Literal
    assert typing.get_args(convbn.Strategy) == ("recompute_conv", "recompute_bn", "frozen")
    assert typing.get_args(convbn.ConvertStrategy) == ("auto", "recompute_bn", "recompute_conv")
    assert typing.get_type_hints(convbn.convert)["strategy"] == convbn.ConvertStrategy
    assert typing.get_type_hints(convbn.conv_bn_act)["strategy"] == convbn.Strategy
    assert typing.get_type_hints(convbn.FusedConvBN2d.__init__)["strategy"] == convbn.Strategy


@pytest.mark.parametrize("where, name, values", [
    (convbn.max_batch, "method", ("predict", "measure")),
    (convbn.BNOutcome, "result", ("fused", "folded", "left")),
    (convbn.BNOutcome, "direction", ("preceding", "following")),
    (convbn.nn.ChainLayer, "mode", ("recompute_bn", "recompute_conv")),
    (convbn.ConvertReport, "strategy", ("auto", "recompute_bn", "recompute_conv")),
])
def test_choices_are_literal_types(where: Any, name: str, values: Tuple[str, ...]) -> None:
    hint = typing.get_type_hints(where)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # Optional[Literal[...]]
    literal = args[0] if typing.get_origin(hint) is typing.Union else hint
    assert typing.get_origin(literal) is typing.Literal and typing.get_args(literal) == values


@pytest.mark.parametrize("fn", [convbn.convert, convbn.fold], ids=["convert", "fold"])
def test_passes_return_the_type_they_were_given(fn: Callable[..., Any]) -> None:
    hints = typing.get_type_hints(fn)
    assert isinstance(hints["return"], TypeVar) and hints["return"] is hints["model"]
    assert hints["return"].__bound__ is nn.Module


class _Net(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_both_passes_attach_their_report_as_convbn_report() -> None:
    converted = convbn.convert(_Net())
    folded = convbn.fold(_Net().eval(), example_inputs=_x())
    assert type(converted) is _Net and type(folded) is _Net
    assert isinstance(converted.convbn_report, convbn.ConvertReport)
    assert isinstance(folded.convbn_report, convbn.FoldReport)
    assert folded.convbn_report.folded and folded.convbn_report.untraced == []
    assert convbn.ConvertReport().untraced == []  # the same name in both reports


@pytest.mark.parametrize("fn", ["convert", "fold"])
def test_inplace_means_the_same_in_both_passes(fn: str) -> None:
    """``inplace=True``: ``model`` itself is rewritten and returned; ``False``: ``model`` keeps its
    module objects, forwards and outputs, and the result is new module objects."""
    def run(model: nn.Module, inplace: bool) -> nn.Module:
        if fn == "convert":
            return convbn.convert(model, inplace=inplace)
        return convbn.fold(model.eval(), inplace=inplace, example_inputs=_x())

    model = _Net()
    before = dict(model.named_modules())
    result = run(model, inplace=False)
    assert result is not model and all(a is not b for a, b in zip(result.modules(), model.modules()))
    assert dict(model.named_modules()) == before and "forward" not in model.__dict__
    assert "convbn_report" not in model.__dict__
    model = _Net()
    assert run(model, inplace=True) is model and "convbn_report" in model.__dict__


# ----------------------------------------------------------------------------- old names


def _old_uses() -> List[Tuple[str, Callable[[], Any], str]]:
    """(id, a use of an old name, the new name its warning must name)."""
    def fold_report() -> Any:
        return convbn.fold(_Net().eval(), example_inputs=_x()).fold_report.folded

    def max_batch_sample() -> Any:
        with pytest.raises(TypeError, match="example_inputs must be a tensor"):
            convbn.max_batch(_Net(), sample=[1], memory="1GiB")

    def cli_budget() -> Any:
        from convbn.cli_explain import add_arguments

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["mnist", "--budget", "0.5"])
        assert args.memory_budget == 0.5

    def set_compile() -> Any:
        prev = chain_compiled.set_compile_chains("op")
        try:
            assert chain_compiled.compile_chains_mode() == "op"
        finally:
            chain_compiled._STATE["mode"] = None

    def set_kernels() -> Any:
        chain_kernels.set_fused_kernels(True)
        try:
            assert chain_kernels.fused_kernels_enabled() or chain_kernels._STATE["failed"]
        finally:
            chain_kernels._STATE["on"] = None

    def bench_budget() -> Any:
        from convbn.bench.training import add_training_arguments

        parser = argparse.ArgumentParser()
        add_training_arguments(parser)
        args = parser.parse_args(["--memory-budget", "0.5", "--budget", "0.25", "--memory-budget", "0.75"])
        assert args.budget == [0.5, 0.25, 0.75]

    import convbn.autograd as ag

    return [
        ("STRATEGIES", lambda: convbn.STRATEGIES, "typing.get_args(convbn.Strategy)"),
        ("CONVERT_STRATEGIES", lambda: convbn.CONVERT_STRATEGIES, "typing.get_args(convbn.ConvertStrategy)"),
        ("LayerMode", lambda: convbn.LayerMode, "convbn.Strategy"),
        ("passes.convert.api.CONVERT_STRATEGIES",
         lambda: importlib.import_module("convbn.passes.convert.api").CONVERT_STRATEGIES,
         "typing.get_args(convbn.ConvertStrategy)"),
        ("RecomputeConvFunction", lambda: ag.RecomputeConvFunction, "conv_bn_act"),
        ("RecomputeBNFunction", lambda: ag.RecomputeBNFunction, "conv_bn_act"),
        ("FoldReport.actions", lambda: convbn.FoldReport().actions, "FoldReport.outcomes"),
        ("FoldReport.untraceable", lambda: convbn.FoldReport().untraceable, "FoldReport.untraced"),
        ("model.fold_report", fold_report, "model.convbn_report"),
        ("max_batch(sample=)", max_batch_sample, "example_inputs="),
        ("explain --budget", cli_budget, "--memory-budget"),
        ("bench --budget", bench_budget, "--memory-budget"),
        ("set_compile_chains", set_compile, "convbn.compile_chains(mode)"),
        ("set_fused_kernels", set_kernels, "convbn.fused_kernels(on)"),
        ("compile_chains()", lambda: chain_compiled.compile_chains(), "compile_chains_mode()"),
    ]


@pytest.mark.parametrize("case", _old_uses(), ids=lambda c: c[0])
def test_old_names_still_work_and_warn(case: Tuple[str, Callable[[], Any], str]) -> None:
    _, use, new = case
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use()
    ours = [w for w in caught if issubclass(w.category, FutureWarning) and "deprecated" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert new in str(ours[0].message), str(ours[0].message)


def test_old_names_warn_at_the_callers_line() -> None:
    with pytest.warns(FutureWarning, match="convbn.STRATEGIES is deprecated") as caught:
        convbn.STRATEGIES
    with pytest.warns(FutureWarning, match="fold_report is deprecated") as caught_attr:
        folded = convbn.fold(_Net().eval(), example_inputs=_x())
        folded.fold_report.folded
    with pytest.warns(FutureWarning, match="sample=") as caught_kwarg:
        with pytest.raises(TypeError):
            convbn.max_batch(_Net(), sample=[1], memory="1GiB")
    for record in (caught, caught_attr, caught_kwarg):
        assert {w.filename for w in record if issubclass(w.category, FutureWarning)} == {__file__}


def test_old_values_equal_the_new() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert convbn.STRATEGIES == typing.get_args(convbn.Strategy)
        assert convbn.CONVERT_STRATEGIES == typing.get_args(convbn.ConvertStrategy)
        folded = convbn.fold(_Net().eval(), example_inputs=_x())
        assert isinstance(folded.fold_report, convbn.FoldReport)
        assert folded.fold_report == folded.convbn_report and str(folded.fold_report) == str(folded.convbn_report)


def test_a_folded_model_scripts_exports_copies_and_pickles_without_the_old_name_warning() -> None:
    import copy
    import io

    folded = convbn.fold(_Net().eval(), example_inputs=_x())
    with warnings.catch_warnings(record=True) as caught:  # recorded: TorchScript swallows exceptions it raises
        warnings.simplefilter("always")
        torch.jit.script(folded)
        torch.export.export(folded, (_x(),))
        copied = copy.deepcopy(folded)
        buf = io.BytesIO()
        torch.save(folded, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    assert not [str(w.message) for w in caught if "convbn 0.3" in str(w.message)]
    for m in (copied, loaded):
        assert isinstance(m.convbn_report, convbn.FoldReport) and m.convbn_report.folded
        with pytest.warns(FutureWarning, match="fold_report is deprecated"):
            assert m.fold_report.folded == m.convbn_report.folded


def test_unknown_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'STRATEGY'"):
        convbn.STRATEGY  # noqa: B018


# ----------------------------------------------------------------------------- scoped switches


@pytest.fixture
def no_switch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVBN_COMPILE_CHAINS", raising=False)
    monkeypatch.delenv("CONVBN_FUSED_KERNELS", raising=False)
    assert chain_compiled._STATE["mode"] is None and chain_kernels._STATE["on"] is None


def test_compile_chains_is_scoped(no_switch_env: None) -> None:
    mode = chain_compiled.compile_chains_mode
    assert mode() == "inductor"
    with convbn.compile_chains("op"):
        assert mode() == "op"
        with convbn.compile_chains("inductor"):
            assert mode() == "inductor"
        assert mode() == "op"
    assert mode() == "inductor" and chain_compiled._STATE["mode"] is None  # the environment decides again
    with pytest.raises(RuntimeError, match="boom"):
        with convbn.compile_chains("op"):
            raise RuntimeError("boom")
    assert mode() == "inductor" and chain_compiled._STATE["mode"] is None
    with pytest.raises(ValueError, match=r"one of \('inductor', 'op'\), but got 'fused'"):
        convbn.compile_chains("fused")  # type: ignore[call-overload]


def test_fused_kernels_is_scoped(no_switch_env: None) -> None:
    on = chain_kernels._switched_on
    assert not on()
    with convbn.fused_kernels(True):
        assert on()
        with convbn.fused_kernels(False):
            assert not on()
        assert on()
    assert not on() and chain_kernels._STATE["on"] is None
    with pytest.raises(RuntimeError, match="boom"):
        with convbn.fused_kernels(True):
            raise RuntimeError("boom")
    assert not on() and chain_kernels._STATE["on"] is None
    with pytest.raises(TypeError, match="expects a bool, but got 'yes'"):
        convbn.fused_kernels("yes")  # type: ignore[arg-type]


def test_environment_is_the_default_and_a_block_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVBN_COMPILE_CHAINS", "op")
    monkeypatch.setenv("CONVBN_FUSED_KERNELS", "1")
    assert chain_compiled.compile_chains_mode() == "op" and chain_kernels._switched_on()
    with convbn.compile_chains("inductor"), convbn.fused_kernels(False):
        assert chain_compiled.compile_chains_mode() == "inductor" and not chain_kernels._switched_on()
    assert chain_compiled.compile_chains_mode() == "op" and chain_kernels._switched_on()


def test_switches_as_decorators_and_reentered(no_switch_env: None) -> None:
    @convbn.compile_chains("op")
    @convbn.fused_kernels(True)
    def inside() -> Tuple[str, bool]:
        return chain_compiled.compile_chains_mode(), chain_kernels._switched_on()

    assert inside() == ("op", True) and inside() == ("op", True)
    assert chain_compiled.compile_chains_mode() == "inductor" and not chain_kernels._switched_on()
    block = convbn.fused_kernels(True)
    with block:
        with block:
            assert chain_kernels._switched_on()
    assert chain_kernels._STATE["on"] is None


def test_switches_are_process_wide_while_a_block_is_open(no_switch_env: None) -> None:
    """Documented: like ``torch.backends.cudnn.flags()``, another thread sees an open block."""
    seen: List[Any] = []
    with convbn.compile_chains("op"), convbn.fused_kernels(True):
        t = threading.Thread(target=lambda: seen.append((chain_compiled.compile_chains_mode(),
                                                         chain_kernels._switched_on())))
        t.start()
        t.join()
    assert seen == [("op", True)]
