"""``convbn::conv`` (Note: [a conv inductor cannot re-layout] in ``convbn/autograd/conv_op.py``):
the values and gradients of ``torch.convolution``, float64 gradcheck and gradgradcheck, the
fake kernel's strides (``torch.library.opcheck``), and the chain layout rule for its output."""
import pytest
import torch

from convbn.autograd.conv_op import conv_op

CASES = [  # (x shape, w shape, bias, stride, padding, dilation, transposed, output_padding, groups)
    ((2, 3, 7, 7), (4, 3, 3, 3), True, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ((2, 4, 8, 8), (6, 2, 3, 3), False, [2, 2], [1, 1], [1, 1], False, [0, 0], 2),
    ((2, 4, 5, 5), (4, 3, 3, 3), True, [2, 2], [1, 1], [1, 1], True, [1, 1], 1),
    ((1, 2, 4, 5, 5), (3, 2, 1, 3, 3), False, [1, 1, 1], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 1),
]


def _args(case, dtype=torch.float64, channels_last=False):
    xs, ws, bias, *geo = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(xs, generator=g, dtype=dtype)
    w = torch.randn(ws, generator=g, dtype=dtype)
    if channels_last and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    b = torch.randn(ws[1] * geo[-1] if geo[3] else ws[0], generator=g, dtype=dtype) if bias else None
    return [x.requires_grad_(), w.requires_grad_(), None if b is None else b.requires_grad_(), *geo]


@pytest.mark.parametrize("case", CASES)
def test_conv_op_is_torch_convolution_with_its_gradients(case):
    args = _args(case)
    out = conv_op(*args)
    ref = torch.convolution(*args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(ref)
    tensors = [a for a in args[:3] if a is not None]
    got = torch.autograd.grad(out, tensors, g)
    want = torch.autograd.grad(ref, tensors, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", CASES)
def test_conv_op_gradcheck_and_gradgradcheck_float64(case):
    args = _args(case)
    n = 3 if args[2] is not None else 2

    def f(*ts):
        return conv_op(*ts, *([None] if n == 2 else []), *args[3:])

    ts = tuple(a for a in args[:3] if a is not None)
    assert torch.autograd.gradcheck(f, ts)
    assert torch.autograd.gradgradcheck(f, ts)


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_op_fake_kernel_and_output_layout(case, channels_last):
    args = _args(case, torch.float32, channels_last)
    torch.library.opcheck(torch.ops.convbn.conv.default, tuple(args))
    out = conv_op(*args)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
