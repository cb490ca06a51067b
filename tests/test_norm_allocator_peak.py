"""Issue 39's meter: a 3-D InstanceNorm -> LeakyReLU U-Net's converted training step within half of
eager's peak *by the CPU allocator* (:func:`convbn.memory.allocator_peak`: every block the allocator
serves, the kernels' own scratch included, exact bytes; no timing), and what gets it there:

* a norm chain's convolution backward computes the weight's gradient first and the input's in a
  second call (Note: [the weight's gradient first] in functional/conv.py): the same bits as one
  call, and a high-water mark of ``max(weight call, input gradient + input call)``;
* a lean max pool keeps int32 indices (Note: [max-pool indices in half the bytes] in
  functional/pool.py).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn.functional.conv import conv_backward, conv_spec_from_module
from convbn.memory import allocator_peak
from fusion_checks import assert_chain_ran, assert_fused

aten = torch.ops.aten


def _block(cin: int, cout: int) -> List[nn.Module]:
    return [nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.1)]


def _two(cin: int, cout: int) -> nn.Sequential:
    """MONAI ``TwoConv``: (Conv -> InstanceNorm -> LeakyReLU) twice."""
    return nn.Sequential(*_block(cin, cout), *_block(cout, cout))


class _UpCat(nn.Module):
    """MONAI ``UpCat`` (``halves=False``) as its forward is written: transposed conv, a replicate
    pad whose widths compare shapes (zero here), concatenation with the skip, ``TwoConv``."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.upsample = nn.ConvTranspose3d(cin, cin, 2, stride=2)
        self.convs = _two(cin + cskip, cout)

    def forward(self, x: Tensor, x_e: Optional[Tensor]) -> Tensor:
        x_0 = self.upsample(x)
        if x_e is not None and torch.jit.isinstance(x_e, torch.Tensor):
            sp = [0] * 6
            for i in range(3):
                if x_e.shape[-i - 1] != x_0.shape[-i - 1]:
                    sp[i * 2 + 1] = 1
            x_0 = F.pad(x_0, sp, "replicate")
            return self.convs(torch.cat([x_e, x_0], dim=1))
        return self.convs(x_0)


class SmallBasicUNet(nn.Module):
    """MONAI ``BasicUNet``'s shape in small (3-D, three levels, a 1x1x1 head)."""

    def __init__(self, c: int = 8, c2: int = 16) -> None:
        super().__init__()
        self.enc, self.pool = _two(1, c), nn.MaxPool3d(2)
        self.down1, self.down2 = _two(c, c2), _two(c2, 2 * c2)
        self.up2, self.up1 = _UpCat(2 * c2, c2, c2), _UpCat(c2, c, c)
        self.head = nn.Conv3d(c, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        e = self.enc(x)
        d1 = self.down1(self.pool(e))
        return self.head(self.up1(self.up2(self.down2(self.pool(d1)), d1), e))


def _step(model: nn.Module, x: Tensor) -> Callable[[], None]:
    """The standard loop's step (SGD with momentum); one step runs here, so that the momentum
    buffers exist before the measured one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).mean().backward()
        opt.step()

    step()
    return step


@pytest.fixture
def one_thread():
    """oneDNN's scratch grows with the threads it runs on: both steps measured on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_small_basic_unet_steps_within_half_of_eager_by_the_allocator(one_thread: None) -> None:
    """Exact allocator bytes, both steps measured the same way: the converted step peaks at or
    below half of eager's, every norm fused, the chains' Function run and its gradients eager's."""
    torch.manual_seed(0)
    base, x = SmallBasicUNet(), torch.randn(2, 1, 16, 16, 16)
    fast = convbn.convert(copy.deepcopy(base), example_inputs=x)
    assert_fused(fast, pairs=10, chains=5)
    out = fast(x)
    assert_chain_ran(out)
    out.mean().backward()
    base(x).mean().backward()
    for (name, p), q in zip(base.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    eager_step, fast_step = _step(base, x), _step(fast, x)
    eager_peak, fast_peak = allocator_peak(eager_step), allocator_peak(fast_step)
    assert 2 * fast_peak <= eager_peak, f"converted {fast_peak} B, eager {eager_peak} B: {fast_peak / eager_peak:.4f}x"


@pytest.mark.parametrize("cin, cout, size, transposed", [(16, 8, 12, False), (4, 8, 10, False), (8, 4, 6, True)])
def test_weight_first_conv_backward_is_the_same_bits_at_a_lower_high_water_mark(cin: int, cout: int, size: int,
                                                                               transposed: bool) -> None:
    """The two calls give one call's values bit for bit, and their peak is exactly the weight
    call's, or the input gradient held beside the input call's (each measured alone), whichever
    is higher: never the input gradient beside the weight kernel's scratch."""
    torch.manual_seed(1)
    x = torch.randn(2, cin, size, size, size)
    w = torch.randn(cin, cout, 2, 2, 2) if transposed else torch.randn(cout, cin, 3, 3, 3)
    conv = (nn.ConvTranspose3d(cin, cout, 2, stride=2) if transposed else nn.Conv3d(cin, cout, 3, padding=1))
    spec = conv_spec_from_module(conv)
    y = F.conv_transpose3d(x, w, stride=2) if transposed else F.conv3d(x, w, padding=1)
    gy = torch.randn_like(y)
    mask = (True, True, True)
    one = conv_backward(gy, x, w, spec, mask)
    two = conv_backward(gy, x, w, spec, mask, weight_first=True)
    for a, b in zip(one, two):
        assert a is not None and b is not None and torch.equal(a, b)
    del one, two
    weight_call = allocator_peak(lambda: conv_backward(gy, x, w, spec, (False, True, True)))
    input_call = allocator_peak(lambda: conv_backward(gy, x, w, spec, (True, False, False)))
    held = w.nbytes + w.shape[1 if transposed else 0] * w.element_size()  # grad_W and grad_b
    assert allocator_peak(lambda: conv_backward(gy, x, w, spec, mask, weight_first=True)) == \
        max(weight_call, held + input_call)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weight_first_and_int32_indices_on_cuda() -> None:
    """On CUDA the two calls give one call's gradients (cuDNN may pick other algorithms per call:
    compared within float32 rounding), and a lean max pool's int32 indices give eager's gradient."""
    from convbn.autograd.pool import lean_pool
    from convbn.functional.pool import PoolSpec

    torch.manual_seed(2)
    dev = torch.device("cuda")
    conv = nn.Conv3d(16, 8, 3, padding=1).to(dev)
    x = torch.randn(2, 16, 12, 12, 12, device=dev)
    gy = torch.randn(2, 8, 12, 12, 12, device=dev)
    spec = conv_spec_from_module(conv)
    one = conv_backward(gy, x, conv.weight.detach(), spec, (True, True, True))
    two = conv_backward(gy, x, conv.weight.detach(), spec, (True, True, True), weight_first=True)
    for a, b in zip(one, two):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    xp = torch.randn(2, 4, 8, 8, 8, device=dev, requires_grad=True)
    xe = xp.detach().clone().requires_grad_()
    g = torch.randn(2, 4, 4, 4, 4, device=dev)
    lean_pool(xp, PoolSpec.make("max", 3, 2, 2)).backward(g)
    F.max_pool3d(xe, 2).backward(g)
    assert torch.equal(xp.grad, xe.grad)
