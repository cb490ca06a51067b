"""The incoming-gradient probe's calibration is measured once, in a clean state, and never
rewritten (issue 23; Note: [calibrated once, in a clean state] in autograd/refcounts.py)."""
from __future__ import annotations

import sys

import torch
from torch import nn

import convbn
from convbn.autograd import refcounts
from fusion_checks import assert_chain_ran, assert_fused


def _locals_tracer(frame, event, arg):
    frame.f_locals  # what debuggers and Python-level coverage tools do: one more reference per local
    return _locals_tracer


def test_a_tracer_at_forward_cannot_make_a_held_gradient_look_fresh(monkeypatch) -> None:
    """A forward run under a tracer that reads frame locals, then a backward without it in
    which the chain's incoming gradient is held twice by the caller (two tensor hooks keep
    it): the held gradient must survive. A calibration taken under the tracer (one
    reference too many) would take "held twice" for "fresh" and free it."""
    monkeypatch.setattr(refcounts, "_CALIBRATED", False)  # a process that has not calibrated yet
    monkeypatch.setattr(refcounts, "_FRESH", None)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
    fast = convbn.convert(net, strategy="recompute_conv")
    assert_fused(fast, pairs=2, chains=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    sys.settrace(_locals_tracer)
    try:
        out = fast(x)
    finally:
        sys.settrace(None)
    assert_chain_ran(out, calls=1)
    kept = []
    out.register_hook(lambda g: kept.append(g))
    out.register_hook(lambda g: kept.append(g))
    upstream = torch.randn_like(out)
    (out * 1).backward(upstream)  # MulBackward hands the chain a fresh gradient, then the hooks keep it
    same = len(kept) == 2 and kept[0] is kept[1]
    assert same
    # (a bool first: printing a freed tensor would read freed memory)
    freed = kept[0].untyped_storage().nbytes() != upstream.numel() * upstream.element_size()
    assert not freed, "the chain freed an incoming gradient the caller holds"
    equal = torch.equal(kept[0], upstream)
    assert equal


def test_calibration_is_written_once(monkeypatch) -> None:
    """Steps, backward passes and tracers do not rewrite the calibration once measured."""
    monkeypatch.setattr(refcounts, "_CALIBRATED", False)
    monkeypatch.setattr(refcounts, "_FRESH", None)
    sys.settrace(_locals_tracer)
    try:
        refcounts.calibrate()  # under a tracer: refused, nothing cached
        assert not refcounts._CALIBRATED
    finally:
        sys.settrace(None)
    torch.manual_seed(0)
    fast = convbn.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), strategy="recompute_conv")
    fast(torch.randn(2, 3, 6, 6, requires_grad=True)).sum().backward()
    assert refcounts._CALIBRATED
    first = refcounts._fresh_counts()
    probe = refcounts._probe
    calls = []
    monkeypatch.setattr(refcounts, "_probe", lambda *a: calls.append(a) or probe(*a))
    for _ in range(2):
        out = fast(torch.randn(2, 3, 6, 6, requires_grad=True))
        assert_chain_ran(out, calls=1)
        out.sum().backward()
    assert calls == [] and refcounts._fresh_counts() == first
