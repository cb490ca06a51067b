"""What the second sweep of per-sample-norm libraries found in the model's state (Note: [a check's
run leaves the model's plain state as it was], Note: [what a rewrite assumes]):

* ``video-diffusion-pytorch``'s ``Unet3D``: ``convert(example_inputs=...)`` ran the model for its
  checks; its ``RotaryEmbedding`` filled a buffer cache and set the cache's length, a plain int;
  the buffer was put back, the length was not, and every later call read a zero cache.
* ``pytorch3dunet``'s ``Decoder`` keeps ``joining``, a ``functools.partial``: the guard kept a
  deep copy of it, never ``==`` to the original, so the guard failed on every call and no
  GroupNorm of the net ran fused.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from convbn.passes.check.validate import StateSnapshot
from fusion_checks import assert_fused


class RotaryCache(nn.Module):
    """rotary_embedding_torch's ``RotaryEmbedding`` in small: a non-persistent buffer cache,
    filled on the first call, and its length as a plain int."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, dtype=torch.float64), persistent=False)
        self.cache_len = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache_len < 4:
            self.cache[:4] = torch.arange(1.0, 5.0, dtype=self.cache.dtype)
            self.cache_len = 4
        return x * self.cache.sum()


class CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
        self.rotary = RotaryCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if bool(y.abs().sum() >= 0):  # a branch on values: the root is not traced, it runs as written
            y = self.rotary(y)
        return y


def test_convert_with_example_inputs_leaves_a_cache_and_its_length_as_they_were() -> None:
    torch.manual_seed(0)
    eager = CachedNet().double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x, strategy="recompute_bn")
    assert fast.rotary.cache_len == 0 and not fast.rotary.cache.any()  # as the user's model was
    report = assert_fused(fast, pairs=2)
    assert [o.result for o in report.outcomes] == ["fused", "fused"]
    assert_steps_match(eager, fast, x, steps=2)


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.zeros(3))
        self.count = 0
        self.name = "a"


def test_state_snapshot_puts_back_plain_attributes_and_buffer_bindings() -> None:
    m = nn.Sequential(Owner())
    owner = m[0]
    kept = owner.kept
    with StateSnapshot(m):
        owner.count = 7
        owner.name = "b"
        owner.lazily_made = 3  # a plain attribute that appeared in the block
        owner.kept = torch.ones(3)  # the buffer name bound to a new tensor
        owner.kept.add_(1)
    assert owner.count == 0 and owner.name == "a"
    assert not hasattr(owner, "lazily_made")
    assert owner.kept is kept and not kept.any()


class Decoder(nn.Module):
    """pytorch3dunet's ``Decoder``: how it joins the skip connection is a ``functools.partial``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.joining = functools.partial(Decoder._joining, concat=True)

    @staticmethod
    def _joining(skip: torch.Tensor, x: torch.Tensor, concat: bool) -> torch.Tensor:
        return torch.cat((skip, x), dim=1) if concat else skip + x

    @staticmethod
    def _swapped(skip: torch.Tensor, x: torch.Tensor, concat: bool) -> torch.Tensor:
        return torch.cat((x, skip), dim=1)

    def forward(self, skip: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(self.joining(skip, x))))


class JoinNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, padding=1)
        self.dec = Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.dec(e, torch.tanh(e))


def test_a_partial_attribute_does_not_fail_the_guard_on_every_call() -> None:
    torch.manual_seed(0)
    eager = JoinNet().double()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    assert_steps_match(eager, fast, x, steps=3)  # the fused chain ran in every step
    report = assert_fused(fast, pairs=1)
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("dec.norm", "fused")], report
    # a real change still counts: joined the other way round, in both models
    swapped = functools.partial(Decoder._swapped, concat=True)
    eager.dec.joining, fast.dec.joining = swapped, swapped
    assert_steps_match(eager, fast, x, steps=1, fused=False)
