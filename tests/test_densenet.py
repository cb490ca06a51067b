"""DenseNet concatenations: the test DenseNet-BC, flattening nested concatenations, and the
checkpoint-based memory-efficient baseline the benchmark compares with (issue 11)."""
from __future__ import annotations

import copy
from typing import List

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from convbn.bench.concat_checkpoint import CheckpointedConcatHead, NoConcatHead, checkpoint_concat_heads
from convbn.bench.training import CONCAT_CHECKPOINT, run_training_bench
from convbn.memory import saved_bytes
from convbn.passes.graph.concat_heads import cat_parts, channel_cat_pieces, flatten_cats, shared_pieces
from densenet_models import DenseNetBC, make_densenet_bc


def _bn_state(model: nn.Module) -> List[Tensor]:
    return [b.detach().clone() for n, b in model.named_buffers()]


# --------------------------------------------------------------------------- the test models


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_list_and_nested_styles_compute_the_same(dims: int) -> None:
    a = make_densenet_bc(style="list", spatial_dims=dims, block_config=(2, 3))
    b = make_densenet_bc(style="nested", spatial_dims=dims, block_config=(2, 3))
    assert list(a.state_dict()) == list(b.state_dict())
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, *(8,) * dims)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    torch.testing.assert_close(_bn_state(a), _bn_state(b), rtol=0, atol=0)


def test_memory_efficient_replica_is_checkpointed_and_double_counts_stats() -> None:
    plain = make_densenet_bc(style="list", block_config=(3,))
    eff = make_densenet_bc(style="list", block_config=(3,), memory_efficient=True)
    eff.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 8, 8)
    out_p, out_e = plain(x), eff(x)
    out_p.sum().backward()
    out_e.sum().backward()
    torch.testing.assert_close(out_p, out_e)
    for p, e in zip(plain.parameters(), eff.parameters()):
        torch.testing.assert_close(p.grad, e.grad)
    nbt = dict(eff.named_buffers())["features.denseblock1.0.norm1.num_batches_tracked"]
    assert nbt.item() == 2  # re-run in backward: the known drawback of checkpointing BN
    assert saved_bytes(eff, x).total < saved_bytes(plain, x).total
    with pytest.raises(ValueError, match="memory_efficient=True needs style='list'"):
        DenseNetBC(style="nested", memory_efficient=True)
    with pytest.raises(ValueError, match="style must be"):
        DenseNetBC(style="dict")


# --------------------------------------------------------------------------- flatten_cats


class _Nested(nn.Module):
    def forward(self, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        ab = torch.cat([a, b], 1)
        abc = torch.concat((ab, c), dim=1)
        return torch.cat([abc, a], 1)


class _InnerUsed(nn.Module):
    def forward(self, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        ab = torch.cat([a, b], 1)
        return torch.cat([ab, c], 1), ab * 2


class _OtherDim(nn.Module):
    def forward(self, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return torch.cat([torch.cat([a, b], 2), torch.cat([c, c], 2)], 1)


def _names(nodes: List[fx.Node]) -> List[str]:
    return [n.name for n in nodes]


def test_flatten_cats_to_leaves_and_erase_unused_inner() -> None:
    gm = fx.symbolic_trace(_Nested())
    leaves = flatten_cats(gm.graph)
    gm.recompile()
    assert [_names(v) for v in leaves.values()] == [["a", "b", "c", "a"]]
    assert sum(cat_parts(n) is not None for n in gm.graph.nodes) == 1
    a, b, c = torch.randn(2, 1, 3), torch.randn(2, 2, 3), torch.randn(2, 3, 3)
    torch.testing.assert_close(gm(a, b, c), _Nested()(a, b, c), rtol=0, atol=0)


def test_flatten_keeps_an_inner_cat_that_has_another_user() -> None:
    gm = fx.symbolic_trace(_InnerUsed())
    leaves = flatten_cats(gm.graph)
    gm.recompile()
    assert sorted(_names(v) for v in leaves.values()) == [["a", "b"], ["a", "b", "c"]]
    a, b, c = torch.randn(2, 1, 3), torch.randn(2, 2, 3), torch.randn(2, 3, 3)
    for got, want in zip(gm(a, b, c), _InnerUsed()(a, b, c)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_flatten_does_not_merge_other_dims_and_channel_dim_rules() -> None:
    gm = fx.symbolic_trace(_OtherDim())
    leaves = flatten_cats(gm.graph)
    outer = [n for n in leaves if cat_parts(n)[1] == 1][0]  # type: ignore[index]
    assert len(leaves[outer]) == 2 and all(cat_parts(p) is not None for p in leaves[outer])
    inner = [n for n in leaves if cat_parts(n)[1] == 2][0]  # type: ignore[index]
    assert channel_cat_pieces(outer, 4) is not None
    assert channel_cat_pieces(inner, 4) is None
    assert channel_cat_pieces(inner, 3) is None  # dim 2 is not 1 - 3
    assert shared_pieces([["a", "b"], ["a", "c"], ["a"]]) == {"a": 3}  # type: ignore[list-item]


def test_negative_channel_dim_counts_as_channel() -> None:
    class M(nn.Module):
        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return torch.cat([a, b], -3)

    node = [n for n in fx.symbolic_trace(M()).graph.nodes if cat_parts(n) is not None][0]
    assert channel_cat_pieces(node, 4) is not None and channel_cat_pieces(node, 5) is None


# --------------------------------------------------------------------------- checkpoint baseline


@pytest.mark.parametrize("style,heads", [("list", 7), ("nested", 5)])
def test_checkpoint_concat_heads_matches_eager_but_updates_stats_twice(style: str, heads: int) -> None:
    eager = make_densenet_bc(style=style, block_config=(3, 3))
    twin = copy.deepcopy(eager)
    params, buffers = list(twin.parameters()), list(twin.buffers())  # the same objects after the rewrite
    ck = checkpoint_concat_heads(twin)
    # every dense layer whose input is a concatenation, and the transition (list: layer 1 too)
    assert ck.num_concat_heads == heads
    assert sum(isinstance(m, CheckpointedConcatHead) for m in ck.modules()) == heads
    x = torch.randn(2, 3, 8, 8)
    out_e, out_c = eager(x), ck(x)
    g = torch.randn_like(out_e)
    out_e.backward(g)
    out_c.backward(g)
    torch.testing.assert_close(out_c, out_e)
    assert {id(p) for p in ck.parameters()} == {id(p) for p in params}
    for (n, p), q in zip(eager.named_parameters(), params):
        torch.testing.assert_close(q.grad, p.grad, msg=n)
    nbt = [b.item() for b in buffers if b.dtype == torch.long]
    assert sorted(nbt) == sorted([1] * (len(nbt) - heads) + [2] * heads)
    assert saved_bytes(ck, x).total < saved_bytes(eager, x).total


def test_checkpoint_concat_heads_needs_a_head() -> None:
    with pytest.raises(NoConcatHead, match="no concatenation head"):
        checkpoint_concat_heads(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()))


def test_bench_has_the_concat_checkpoint_row_only_for_concatenating_models() -> None:
    model = make_densenet_bc(style="nested", block_config=(2, 2))
    rows = run_training_bench("densenet-bc", batch_size=2, configs=["checkpoint", "concat_checkpoint"], steps=1,
                              warmup=0, memory_rounds=1, use_compile=False, progress=False, model=model,
                              input_shape=(3, 8, 8))
    assert [r.config for r in rows] == ["eager", "checkpoint per block", CONCAT_CHECKPOINT]
    row = rows[2]
    assert "heads checkpointed" in row.note and "running stats differ" in row.note, row.note
    assert row.activation_bytes is not None and row.activation_bytes < rows[0].activation_bytes  # type: ignore[operator]
    mnist = run_training_bench("mnist", batch_size=2, configs=None, steps=1, warmup=0, memory_rounds=0,
                               use_compile=False, progress=False)
    assert CONCAT_CHECKPOINT not in [r.config for r in mnist]
    asked = run_training_bench("mnist", batch_size=2, configs=["concat_checkpoint"], steps=1, warmup=0,
                               memory_rounds=0, use_compile=False, progress=False)
    assert asked[1].note.startswith("failed: NoConcatHead") and "no concatenation head" in asked[1].note
