"""Every norm a model calls gets an outcome in the report (NORMS_BUGS 6 and 7).

Minimal repros of two diffusers patterns: a U-Net whose forward takes the timesteps as a
second (integer tensor) input, so the root cannot be traced and its lone GroupNorm child
was converted by nobody; and an attention block whose GroupNorm is called by a non-module
processor object. The set of norm modules called in an eager forward must equal the set
the report lists (fused + left), and the converted model must match eager."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convbn

NORM_TYPES = (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d,
              nn.BatchNorm3d)


class ResBlock(nn.Module):  # diffusers ResnetBlock2D, reduced: forward(input_tensor, temb)
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.temb = nn.Linear(16, c)
        self.norm2 = nn.GroupNorm(4, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(temb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class TimestepUNet(nn.Module):  # diffusers UNet2DModel called as model(x, t)
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.emb = nn.Linear(16, 16)
        self.res1 = ResBlock(8)
        self.res2 = ResBlock(8)
        self.conv_norm_out = nn.GroupNorm(4, 8)
        self.conv_out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x, t):
        if not torch.is_tensor(t):  # diffusers' get_timestep_embedding preamble
            t = torch.tensor([t])
        t = t.expand(x.shape[0])
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) / 8)
        e = t[:, None].float() * freqs[None]
        temb = self.emb(torch.cat([e.sin(), e.cos()], -1))
        h = self.res2(self.res1(self.conv_in(x), temb), temb)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


class Processor:  # diffusers AttnProcessor: a plain object calling the block's group_norm
    def __call__(self, attn, h):
        input_ndim = h.ndim
        if input_ndim == 4:  # diffusers' processors branch on the input's rank
            b, c, hh, ww = h.shape
            h = h.view(b, c, hh * ww).transpose(1, 2)
        h = attn.group_norm(h.transpose(1, 2)).transpose(1, 2)
        q = attn.to_q(h)
        if input_ndim == 4:
            q = q.transpose(-1, -2).reshape(b, c, hh, ww)
        return q


class Attention(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(4, c)
        self.to_q = nn.Linear(c, c)
        self.processor = Processor()

    def forward(self, x, **cross_attention_kwargs):
        # diffusers' Attention.forward filters its kwargs first: iterating them stops fx
        unused = [k for k, _ in cross_attention_kwargs.items() if k != "scale"]
        assert not unused
        return x + self.processor(self, x)


class AttnVAE(nn.Module):  # AutoencoderKL's mid block, reduced
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.attn = Attention(8)
        self.conv_norm_out = nn.GroupNorm(4, 8)
        self.conv_out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        return self.conv_out(F.silu(self.conv_norm_out(self.attn(self.conv_in(x)))))


def _cases():
    return {
        "timestep-unet": (TimestepUNet, lambda: (torch.randn(2, 3, 8, 8), torch.tensor([10, 500]))),
        "processor-attn": (AttnVAE, lambda: (torch.randn(2, 3, 8, 8),)),
    }


def _called_norms(model: nn.Module, args) -> set:
    called, hooks = set(), []
    for name, m in model.named_modules():
        if isinstance(m, NORM_TYPES):
            hooks.append(m.register_forward_hook(lambda mod, i, o, name=name: called.add(name)))
    try:
        model(*args)
    finally:
        for h in hooks:
            h.remove()
    return called


@pytest.mark.parametrize("with_inputs", [False, True], ids=["lazy", "example_inputs"])
@pytest.mark.parametrize("case", list(_cases()))
def test_every_called_norm_has_an_outcome(case: str, with_inputs: bool) -> None:
    torch.manual_seed(0)
    cls, make = _cases()[case]
    model = cls()
    args = make()
    called = _called_norms(model, args)
    assert called  # the repro does call its norms as modules

    eager = copy.deepcopy(model)
    conv = convbn.convert(model, example_inputs=args if with_inputs else None)
    xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    xe = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    out = conv(*xs)
    ref = eager(*xe)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xe[0].grad, rtol=1e-4, atol=1e-5)
    for (n, p), (_, q) in zip(conv.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)

    outcomes = conv.convbn_report.outcomes
    reported = {o.batchnorm for o in outcomes}
    assert reported == called, (sorted(called - reported), sorted(reported - called))
    for o in outcomes:
        assert o.result in ("fused", "left")
        if o.result == "left":
            assert o.reason
    names = [o.batchnorm for o in outcomes]
    assert len(names) == len(set(names))  # each norm once


class DataBranch(nn.Module):  # a data-dependent branch: no trace can follow it
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8)

    def forward(self, x):
        y = self.norm(self.conv(x))
        return y * 2 if y.sum() > 0 else y


@pytest.mark.expect_unfused("a data-dependent branch: the root cannot be traced")
def test_unreached_norm_says_which_module_was_not_traced() -> None:
    conv = convbn.convert(DataBranch())
    conv(torch.randn(2, 3, 6, 6))
    (o,) = [o for o in conv.convbn_report.outcomes if o.batchnorm == "norm"]
    assert o.result == "left"
    assert "'<root>', which could not be traced as a whole (TraceError:" in o.reason  # and why


@pytest.mark.parametrize("case,norm,result,why", [
    ("timestep-unet", "conv_norm_out", "fused", ""),  # traced as called (tests/test_norm_tracing.py)
    ("processor-attn", "attn.group_norm", "left", "it follows method .transpose()")])  # traced on its call's shapes
def test_diffusers_patterns_are_traced_and_their_norms_reported(case: str, norm: str, result: str, why: str) -> None:
    cls, make = _cases()[case]
    conv = convbn.convert(cls())
    conv(*make())
    (o,) = [o for o in conv.convbn_report.outcomes if o.batchnorm == norm]
    assert o.result == result and why in o.reason, o


class TokenLayerNorm(nn.Module):  # a conv stem, then a transformer-style LayerNorm over tokens
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        tokens = torch.relu(self.bn(self.conv(x))).flatten(2).transpose(1, 2)
        return self.fc(self.ln(tokens))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["lazy", "example_inputs"])
def test_a_layer_norm_over_tokens_is_not_reported_as_a_norm_left(with_inputs: bool) -> None:
    """A LayerNorm over tokens is no convolution's norm: the report does not list it (a ``left``
    outcome would say it is not called, which is false), and the BatchNorm before it fuses."""
    torch.manual_seed(0)
    model, x = TokenLayerNorm(), torch.randn(2, 3, 8, 8)
    out = convbn.convert(copy.deepcopy(model), example_inputs=x if with_inputs else None)
    torch.testing.assert_close(out(x), model(x))
    results = {o.batchnorm: o.result for o in out.convbn_report.outcomes}
    assert results == {"bn": "fused"}
