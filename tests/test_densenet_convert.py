"""``convbn.convert`` on DenseNets (issue 11): exact training steps, memory linear in depth.

Compared with eager PyTorch over several SGD steps with random upstream gradients: outputs,
every gradient, running statistics and ``num_batches_tracked``; the checkpoint-based
memory-efficient baseline is shown to get the running statistics wrong where convbn does not.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn import FusedChain
from convbn.bench.concat_checkpoint import checkpoint_concat_heads
from convbn.memory import saved_bytes, tensor_peak
from densenet_models import make_densenet_bc

monai_nets = pytest.importorskip("monai.networks.nets")

Step = Tuple[Tensor, Dict[str, Tensor], Dict[str, Tensor]]


def _train(model: nn.Module, x: Tensor, steps: int, params: List[str]) -> List[Step]:
    """``steps`` SGD steps (random upstream gradient, then ``.sum()`` on the last); per step the
    output, the gradients (by the eager parameter names) and every buffer."""
    named = {n.replace("_orig_mod.", ""): p for n, p in model.named_parameters()}  # torch.compile's wrapper
    plist = [named[n] for n in params]
    opt = torch.optim.SGD(plist, lr=0.05, momentum=0.9)
    model.train()
    result: List[Step] = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        if s == steps - 1:
            out.sum().backward()
        else:
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(s), dtype=out.dtype))
        grads = {n: p.grad.detach().clone() for n, p in zip(params, plist)}
        opt.step()
        result.append((out.detach().clone(), grads,
                       {n.replace("_orig_mod.", ""): b.detach().clone() for n, b in model.named_buffers()}))
    return result


def _compare(got: List[Step], want: List[Step], rtol: float, atol: float) -> None:
    for s, ((o, g, b), (oe, ge, be)) in enumerate(zip(got, want)):
        torch.testing.assert_close(o, oe, rtol=rtol, atol=atol, msg=lambda m: f"step {s} output: {m}")
        assert g.keys() == ge.keys()
        for n in ge:
            scale = float(ge[n].abs().max())
            torch.testing.assert_close(g[n], ge[n], rtol=rtol, atol=atol * max(scale, 1.0),
                                       msg=lambda m: f"step {s} grad {n}: {m}")
        assert b.keys() == be.keys()
        for n in be:
            torch.testing.assert_close(b[n], be[n], rtol=rtol, atol=atol, msg=lambda m: f"step {s} buffer {n}: {m}")


def _fused_bns(model: nn.Module) -> List[str]:
    return [p.bn for p in model.convbn_report.pairs]


@pytest.mark.parametrize("style", ["list", "nested"])
def test_densenet_bc_float64_exact(style: str) -> None:
    eager = make_densenet_bc(style=style, block_config=(3, 2), growth_rate=3).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    names = [n for n, _ in eager.named_parameters()]
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    _compare(_train(fast, x, 3, names), _train(eager, x, 3, names), rtol=0, atol=1e-10)


def _concat_bns(model: nn.Module) -> List[str]:
    """The BatchNorms that normalise a concatenation: each dense layer's first and each transition's."""
    return [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)
            and (n.endswith(".norm1") or (".transition" in n and n.endswith(".norm")))]


@pytest.mark.parametrize("style", ["list", "nested"])
def test_densenet_bc_heads_are_fused_and_keep_pieces(style: str) -> None:
    eager = make_densenet_bc(style=style, block_config=(3, 3))
    x = torch.randn(2, 3, 8, 8)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = fast.convbn_report
    fused = set(_fused_bns(fast))
    heads = _concat_bns(eager)
    assert set(heads) <= fused, sorted(set(heads) - fused)
    assert report.shared_pieces and max(report.shared_pieces.values()) >= 3
    assert "shared pieces" in str(report)
    explained = convbn.explain(copy.deepcopy(eager), x)
    assert explained.shared_pieces == report.shared_pieces and "shared pieces" in str(explained)
    # no concatenation feeds a BatchNorm any more (the heads take the pieces)
    for node in fast.forward.graph.nodes:
        if node.op == "call_module" and isinstance(fast.get_submodule(str(node.target)), _BatchNorm):
            assert not (node.args[0].op == "call_function" and node.args[0].target is torch.cat) or \
                node.target == "features.norm5", node
    assert saved_bytes(fast, x).activation_bytes < 0.5 * saved_bytes(eager, x).activation_bytes


def _monai(dims: int) -> nn.Module:
    torch.manual_seed(0)
    return monai_nets.DenseNet121(spatial_dims=dims, in_channels=2, out_channels=3)


def _within_eager_error(got: List[Step], eager: List[Step], exact: List[Step], factor: float = 4.0,
                        rtol: float = 1e-5) -> None:
    """float32 on real models: each tensor's error vs a float64 eager run is at most ``factor``
    times eager float32's own error (plus ``rtol`` of its scale). A BatchNorm over a handful
    of values (a 1x1 map, batch 2) amplifies rounding, so fixed tolerances do not fit."""
    for s, ((o, g, b), (oe, ge, be), (o64, g64, b64)) in enumerate(zip(got, eager, exact)):
        pairs = [("output", o, oe, o64)] + [(f"grad {n}", g[n], ge[n], g64[n]) for n in g64] + \
            [(n, b[n], be[n], b64[n]) for n in b64 if b64[n].is_floating_point()]
        for what, t, te, t64 in pairs:
            ref = t64.to(t.dtype)
            err, err_eager = float((t - ref).abs().max()), float((te - ref).abs().max())
            scale = float(ref.abs().max())
            assert err <= factor * err_eager + rtol * max(scale, 1e-3), f"step {s} {what}: {err} vs eager's {err_eager}"
        assert torch.equal(b["features.norm0.num_batches_tracked"], be["features.norm0.num_batches_tracked"])


@pytest.mark.parametrize("dims,shape", [(2, (2, 2, 32, 32)), (3, (2, 2, 32, 32, 32))])
def test_monai_densenet121_training_steps_equal_eager(dims: int, shape: Tuple[int, ...]) -> None:
    eager = _monai(dims)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = fast.convbn_report
    assert len([b for b in _fused_bns(fast) if b.endswith("norm1")]) == 58  # every dense layer's head
    assert [s.bn for s in report.skipped] == ["features.norm5"]  # BN -> ReLU -> pool: no conv to fuse into
    # 54 heads read a concatenation (pieces); a block's first layer reads the block input
    assert sum(1 for _, c in convbn.fused_modules(fast) if isinstance(c, FusedChain) and c.layers[0].is_head) == 61
    names = [n for n, _ in eager.named_parameters()]
    exact = _train(copy.deepcopy(eager).double(), x.double(), 3, names)
    want = _train(eager, x, 3, names)
    got = _train(fast, x, 3, names)
    _compare(got[:1], want[:1], rtol=1e-4, atol=1e-4)  # the first step: same weights, same kernels
    _within_eager_error(got, want, exact)


def test_running_stats_equal_eager_where_checkpointing_does_not() -> None:
    eager = make_densenet_bc(style="nested", block_config=(3, 3))
    x = torch.randn(2, 3, 8, 8)
    names = [n for n, _ in eager.named_parameters()]
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    ck_model = copy.deepcopy(eager)
    ck_buffers = dict(ck_model.named_buffers())  # the same objects after the rewrite
    ck = checkpoint_concat_heads(ck_model)
    want = _train(eager, x, 2, names)
    _compare(_train(fast, x, 2, names), want, rtol=1e-5, atol=1e-5)
    ck_params = dict(ck_model.named_parameters())
    opt = torch.optim.SGD([ck_params[n] for n in names], lr=0.05, momentum=0.9)
    for s in range(2):
        opt.zero_grad()
        out = ck(x)
        out.sum().backward() if s == 1 else out.backward(
            torch.randn(out.shape, generator=torch.Generator().manual_seed(s)))
        opt.step()
    nbt = {n: b for n, b in ck_buffers.items() if n.endswith("num_batches_tracked")}
    assert nbt["features.denseblock1.1.norm1.num_batches_tracked"].item() == 4  # counted twice per step
    assert not torch.allclose(ck_buffers["features.denseblock1.1.norm1.running_var"],
                              want[-1][2]["features.denseblock1.1.norm1.running_var"])


def test_double_backward_matches_eager() -> None:
    eager = make_densenet_bc(style="nested", block_config=(2, 2), growth_rate=3).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    assert fast.convbn_report.shared_pieces

    def penalty(model: nn.Module) -> List[Tensor]:
        xi = x.clone().requires_grad_()
        out = model(xi)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        gx.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(penalty(fast), penalty(eager)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_torch_compile_fullgraph_with_pieces() -> None:
    eager = make_densenet_bc(style="list", block_config=(2,), growth_rate=3)
    x = torch.randn(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    names = [n for n, _ in eager.named_parameters()]
    _compare(_train(compiled, x, 2, names), _train(eager, x, 2, names), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def densenet121_b8_128() -> Tuple[nn.Module, nn.Module, nn.Module, Tensor]:
    torch.manual_seed(0)
    eager = monai_nets.DenseNet121(spatial_dims=2, in_channels=3, out_channels=10)
    x = torch.randn(8, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    return eager, fast, checkpoint_concat_heads(copy.deepcopy(eager)), x


@pytest.mark.slow
def test_densenet121_saved_bytes_below_030_and_the_checkpoint_variant(densenet121_b8_128) -> None:
    eager, fast, ck, x = densenet121_b8_128
    e, f, c = (saved_bytes(m, x).activation_bytes for m in (eager, fast, ck))
    assert f <= 0.30 * e, f / e
    assert f < c, (f, c)


@pytest.mark.slow
def test_densenet121_step_peak_below_half_of_eager(densenet121_b8_128) -> None:
    eager, fast, _, x = densenet121_b8_128
    peaks = []
    for m in (eager, fast):
        with tensor_peak(m) as tp:
            m(x).sum().backward()
        peaks.append(tp.result.peak)
        m.zero_grad(set_to_none=True)
    assert peaks[1] <= 0.5 * peaks[0], peaks[1] / peaks[0]


def _torchvision_models() -> object:
    """``torchvision.models``, imported without its fake-kernel registrations (this torch build
    lacks torchvision's C++ ops, which those registrations look up); skips if absent."""
    import sys
    import types

    if "torchvision.models" not in sys.modules:
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    try:
        import torchvision.models as models
    except Exception as exc:  # noqa: BLE001 - any broken install: skip, the MONAI tests cover the same
        pytest.skip(f"torchvision does not import here: {exc}")
    return models


def test_torchvision_densenet121_exact_and_below_its_memory_efficient_variant() -> None:
    models = _torchvision_models()
    torch.manual_seed(0)
    eager = models.densenet121(weights=None, num_classes=10)  # type: ignore[attr-defined]
    ck = models.densenet121(weights=None, num_classes=10, memory_efficient=True)  # type: ignore[attr-defined]
    ck.load_state_dict(eager.state_dict())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    assert [s.bn for s in fast.convbn_report.skipped] == ["features.norm5"]
    assert fast.convbn_report.shared_pieces
    e, f, c = (saved_bytes(copy.deepcopy(m), x).activation_bytes for m in (eager, fast, ck))
    assert f <= 0.3 * e and f < c, (f / e, c / e)
    names = [n for n, _ in eager.named_parameters()]
    want = _train(eager, x, 1, names)
    _compare(_train(fast, x, 1, names), want, rtol=1e-4, atol=1e-4)
    got_ck = _train(ck, x, 1, names)  # torchvision's checkpointing re-runs BN in backward
    assert got_ck[0][2]["features.denseblock1.denselayer2.norm1.num_batches_tracked"].item() == 2
    assert want[0][2]["features.denseblock1.denselayer2.norm1.num_batches_tracked"].item() == 1
