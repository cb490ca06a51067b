#!/usr/bin/env python
"""Mutation testing: deliberate bugs in convbn, one at a time, that the tests must catch.

Each mutant is a small source edit applied to a *temporary copy* of ``src/convbn`` (the
tree is never modified); the tests then run against that copy (``PYTHONPATH`` first) in a
subprocess. A mutant the tests do not fail on has *survived*: the suite would stay green if
that bug were real. Every mutant must be killed.

Usage::

    python scripts/mutants.py                   # every mutant against its fast subset
    python scripts/mutants.py fused_forward_eager planner_keeps_all
    python scripts/mutants.py --tests tests/    # every mutant against the whole suite (slow)
    python scripts/mutants.py --measure         # the fused-forward mutant on the whole default
                                                # suite: fraction of convert-calling tests failing

``tests/test_mutants.py`` runs each mutant against its subset in CI. A mutant whose edit no
longer applies (the code it edits changed) is an error, not a pass: update its edit.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "convbn")

__all__ = ["Mutant", "MUTANTS", "WarmPytest", "apply_mutant", "run_mutant", "main"]


@dataclass(frozen=True)
class Mutant:
    """A deliberate bug: ``edits`` of ``(file under src/convbn, old text, new text)``, each old
    text found exactly once; ``tests``: the fast subset (pytest arguments) that must kill it."""

    doc: str
    edits: Tuple[Tuple[str, str, str], ...]
    tests: Tuple[str, ...] = field(default=())


# Fast subsets of the suite, by what they compare (each mutant lists those that must kill it).
_CHAIN = "tests/test_chain_tails.py::test_every_dropout_kind[0.3-Dropout-recompute_conv]"  # float64 1e-10, RNG,
# running stats, num_batches_tracked, every gradient, and the fusion watch
_PLAN_ALL = "tests/test_planner.py::test_budget_one_keeps_every_conv_output"
_PLAN_SOME = "tests/test_planner.py::test_predicted_saved_bytes_are_exact_and_monotone"
_FOLD = "tests/test_fold.py::test_report_str_lists_every_bn"
_POOL = "tests/test_lean_pools.py::test_function_saves_no_input_for_a_contiguous_one"
_OP_PLAN = "tests/test_chain_op_plan.py::test_compiled_op_backward_reads_may_drop_from_the_plan"
_DROPS = "tests/test_peak_drops.py"
_MISH = "tests/test_convert_tails.py::test_tail_fused_exactly[F.mish-recompute_bn]"
_FOLD_RULE = "tests/test_tolerance_rule.py::test_each_check_reads_the_one_rule[fold check-nothing allowed]"
# tests/test_dtype_eps_norms.py: the test each of these mutants fails (the whole file kills them
# too, but runs 15 to 26 passing tests before it)
_DTYPES = "tests/test_dtype_eps_norms.py::"
_DTYPE_BF16 = _DTYPES + "test_bf16_autocast_runs_a_variant_with_its_own_eps"
_DTYPE_GAIN_CAST = _DTYPES + "test_a_norm_casting_its_gain_under_autocast_runs_its_own_code_and_says_so"
_DTYPE_ZERO_BIAS = _DTYPES + "test_a_pre_norm_with_a_zero_bias_before_a_conv_fuses"
_DTYPE_ZERO_ADDS = _DTYPES + "test_additions_of_zero_dropped_only_where_they_change_nothing"
# the check at the example batch itself (the slice's case passes on the check's mutants below)
_PEAK_AT_BATCH = "tests/test_convert_peak.py::test_convert_peaks_within_one_eager_training_step[example batch]"

MUTANTS: Dict[str, Mutant] = {
    "fused_forward_eager": Mutant(
        "FusedChain runs every call as eager modules (nothing fused at run time, numbers equal to eager's)",
        (("nn/chain.py", "return self._forward_fused(pieces, input)", "return self._forward_eager(_concat(pieces))"),),
        (_CHAIN,)),
    "planner_keeps_all": Mutant(
        "the auto planner keeps every conv output (recompute_bn everywhere)",
        (("passes/plan/chain_plans.py", "keep = tuple(bool(k) for k in keeps)", "keep = tuple(True for k in keeps)"),),
        (_PLAN_SOME,)),
    "planner_keeps_nothing": Mutant(
        "the auto planner keeps no conv output (recompute_conv everywhere)",
        (("passes/plan/chain_plans.py", "keep = tuple(bool(k) for k in keeps)", "keep = tuple(False for k in keeps)"),),
        (_PLAN_ALL,)),
    "planner_drops_everywhere": Mutant(
        "the auto planner's may_drop flags are ignored: every chain's backward drops and rebuilds inputs",
        (("passes/plan/chain_plans.py", "drops = (bool(may_drop),) * len(keep) if", "drops = (True,) * len(keep) if"),),
        (_DROPS,)),
    "dropout_fresh_rng": Mutant(
        "dropout replay in backward draws from a fresh RNG state instead of the captured one",
        (("functional/tail.py", "            mode.generator(device).set_state(cpu)\n",
          "            mode.generator(device).manual_seed(torch.initial_seed() + 1)\n"),),
        (_CHAIN,)),
    "running_stats_skipped": Mutant(
        "the BatchNorm running-statistics update is skipped",
        (("functional/batchnorm.py",
          "y, weight, bias, running_mean, running_var, True, spec.momentum, spec.eps\n        )",
          "y, weight, bias, None, None, True, spec.momentum, spec.eps\n        )"),),
        (_CHAIN,)),
    "num_batches_not_tracked": Mutant(
        "num_batches_tracked is not incremented by a fused training forward",
        (("nn/sync.py", "            bn.num_batches_tracked.add_(1)\n", "            pass\n"),),
        (_CHAIN,)),
    "fold_nothing": Mutant(
        "fold() folds nothing (returns the model unfolded)",
        (("passes/fold/api.py", '    fold_module(run.work, "", run.ctx, set())\n', "    pass  # mutant: nothing folded\n"),),
        (_FOLD,)),
    "fold_check_skipped": Mutant(
        "fold()'s numerical check is skipped",
        (("passes/fold/api.py", "    finer = _checked(run) if run.check and run.args is not None else None",
          "    finer = None  # mutant: the check skipped"),),
        (_FOLD,)),
    "weight_grad_scaled": Mutant(
        "the first convolution's weight gradient of every chain is scaled by (1 + 1e-6)",
        (("autograd/chain.py",
          "        del grad_y, x\n",
          "        del grad_y, x\n        if i == 0 and gw is not None:  # before the sink adds it into .grad\n"
          "            gw = gw * (1 + 1e-6)\n"),),
        (_CHAIN,)),
    "lean_pool_keeps_input": Mutant(
        "the lean pooling keeps its whole input for backward, as eager pooling does",
        (("autograd/pool.py", "keep = not stand_in_fits(x)", "keep = True"),),
        (_POOL,)),
    "op_may_drop_ignored": Mutant(
        "may_drop ignored on the op path: under torch.compile the custom op lets every layer drop and rebuild",
        (("autograd/chain_op.py", "             [s.may_drop for s in specs])", "             [True for s in specs])"),),
        (_OP_PLAN,)),
    "activation_spelling_dropped": Mutant(
        "F.mish missing from the activation table's spellings: matching no longer sees it",
        (("functional/activations.py", "functions=(F.mish,), fused_forward=True", "fused_forward=True"),),
        (_MISH,)),
    "fold_check_own_tolerance": Mutant(
        "fold's check holds a tolerance of its own instead of reading the one rule",
        (("passes/fold/fold_check.py", '    rule = tolerance_rule("fold")\n',
          "    rule = tolerance_rule.__globals__['ToleranceRule']({torch.float64: 1e-10, torch.float32: 1e-4}, 1e-2)\n"),),
        (_FOLD_RULE,)),
    "time_budget_ignored": Mutant(
        "convert(time_budget=...) plans as if every plan fitted the time: the lowest peak whatever it costs",
        (("passes/plan/time_planner.py", "    allowed = int(((time_budget - TIME_MARGIN) * step.eager - step.base) * 1e9)",
          "    allowed = 1 << 62"),),
        ("tests/test_time_budget.py::test_a_tight_time_budget_recomputes_no_conv",)),
    "peak_price_fixed_only": Mutant(
        "the default plan prices a byte of peak at the fixed 16 alone, not against the chains' work",
        (("passes/plan/peak_planner.py", "PEAK_WORK_SHARE = 1.0\n", "PEAK_WORK_SHARE = 0.0\n"),),
        ("tests/test_peak_work_share.py::test_recorded_resnet18_takes_its_lowest_peak",)),
    "peak_price_lower_of_two": Mutant(
        "the price of a byte of peak is the lower of the fixed price and the work share's, not the higher",
        (("passes/plan/peak_planner.py", "work_share * work / lowest <= byte_cost:", "work_share * work / lowest >= byte_cost:"),),
        ("tests/test_peak_work_share.py::test_peak_byte_cost_is_the_higher_price",)),
    "peak_price_first_chain_work": Mutant(
        "the work a byte of peak is priced against is the first chain's, not every chain's",
        (("passes/plan/peak_planner.py", "    work = sum(sum(c.macs) for c in costs)\n", "    work = sum(costs[0].macs)\n"),),
        ("tests/test_peak_memory.py::test_plan_for_peak_is_least_recompute_at_the_allowed_peak",)),
    "frontier_keeps_dominated": Mutant(
        "the frontier keeps a point as slow as a lower-peak one (dominated points marked as choices)",
        (("bench/frontier.py", "        if t < best_time or", "        if t <= best_time or"),),
        ("tests/test_frontier.py::test_pareto_front_cases",)),
    "shape_trace_signature_defaults": Mutant(
        "convert traces a module with the example's real inputs for its signature's optional arguments, not the call's",
        (("passes/convert/pipeline.py", "        return trace_example_call(module, example, training=True)",
          "        return trace(module, LayerTracer, training=True, example=example)"),),
        ("tests/test_report_calls.py::test_report_after_convert_with_inputs_is_what_the_first_step_runs",)),
    "fold_shape_trace_signature_defaults": Mutant(
        "fold traces a module with the sample's real inputs for its signature's optional arguments, not the call's",
        (("passes/fold/api.py", "        return trace_example_call(module, example)",
          "        return trace(module, LayerTracer, example=example)"),),
        ("tests/test_report_calls.py::test_fold_traces_a_module_for_the_call_its_example_makes",)),
    "report_first_capture_only": Mutant(
        "the live report never reads what each kind of call ran: a module called unlike its capture keeps the first capture's outcome",
        (("passes/report/calls_seen.py", '    return main.__dict__.get("seen")\n', "    return None\n"),),
        ("tests/test_report_variants.py::test_report_says_what_calls_with_the_other_argument_ran[False-groupnorm]",)),
    "report_calls_never_cleared": Mutant(
        "the live report reads every call since convert, not the calls since it last read them",
        (("passes/report/calls_seen.py", "        ran.clear()\n", ""),),
        ("tests/test_report_variants.py::test_report_says_what_calls_with_the_other_argument_ran[False-batchnorm]",)),
    "report_variant_fuses_every_layer": Mutant(
        "the live report takes a layer as fused in a variant's calls whether or not the variant fuses it",
        (("passes/report/live.py", "    return f\"fallback: the capture for these calls does not fuse it", "    return FUSED\n    return f\"fallback: the capture for these calls does not fuse it"),),
        ("tests/test_report_variants.py::test_both_kinds_of_call_since_the_last_read_are_both_said[batchnorm]",)),
    "report_variant_fused_ignored": Mutant(
        "the live report keeps 'left' for a norm the first capture left although the variant its calls ran fuses it",
        (("passes/report/convert_report.py", "        theirs = variant_only_status(model) if model is not None else {}",
          "        theirs = {}"),),
        ("tests/test_report_variants.py::test_a_norm_only_a_variant_fuses_is_reported_fused_when_its_calls_ran[True-batchnorm]",)),
    "check_off_call_reported": Mutant(
        "a call of convert's own check off the traced values leaves the report saying fallback",
        (("passes/convert/pipeline.py", '                fwd.off_call = ""\n', ""),),
        ("tests/test_report_calls.py::test_report_after_convert_is_not_left_by_convert_s_own_check",)),
    "computed_weight_no_grad": Mutant(
        "a computed conv weight (StdConv2d) reaches the chain detached: its parameters get no gradient",
        (("nn/computed_weight.py", "        out = self.program(*self.inputs())", "        out = self.program(*self.inputs()).detach()"),),
        ("tests/test_computed_weights.py::test_hand_written_weight_standardisation_fuses_and_trains_as_eager",)),
    "computed_weight_ignored": Mutant(
        "a chain layer convolves with the stored parameter, not the weight the model computes from it",
        (("nn/chain_layer.py", "        if self.computed is not None:  # Note", "        if False:  # Note"),),
        ("tests/test_computed_weights.py::test_timm_std_conv_with_group_norm_act_fuses_and_trains_as_eager",)),
    "computed_weight_from_input": Mutant(
        "a weight computed from an activation is taken as a computed weight",
        (("passes/graph/computed_weight.py", '            return "it is computed from the module\'s inputs"', "            continue"),),
        ("tests/test_computed_weights.py::test_a_weight_not_computed_from_parameters_alone_is_not_taken",)),
    "computed_weight_every_read": Mutant(
        "a computed weight is computed at every read of a call (no per-call cache)",
        (("nn/computed_weight.py", "        if cache is None:\n            return self.compute()",
          "        if True:\n            return self.compute()"),),
        ("tests/test_computed_weights.py::test_the_weight_is_computed_once_per_call_and_read_from_the_parameters_of_that_call",)),
    "norm_heads_not_split": Mutant(
        "a per-sample pre-activation head read by two convs is not given one head per conv",
        (("passes/convert/match.py", "split_shared_heads(gm, root, prefix, joins) + split_shared_norm_heads(gm, root, prefix, joins)",
          "split_shared_heads(gm, root, prefix, joins)"),),
        ("tests/test_computed_weights.py::test_a_per_sample_pre_activation_head_read_by_two_convs_gets_one_head_each",)),
    "norm_heads_split_with_stats": Mutant(
        "a pre-activation norm with running statistics is copied per conv (its statistics updated twice)",
        (("passes/convert/shared_heads.py", "        if view.stats() != (None, None) or (view.module_call",
          "        if (view.module_call"),),
        ("tests/test_computed_weights.py::test_a_pre_activation_norm_with_running_statistics_read_by_two_convs_is_not_copied",)),
    "computed_weights_one_chain": Mutant(
        "several computed-weight layers in one chain (their weight gradients all held at once in backward)",
        (("passes/convert/match.py", "and not (l.conv.computed is not None and _computes_weight(where[id(prev)]))",
          "and True"),),
        ("tests/test_computed_weights.py::test_timm_std_conv_with_group_norm_act_fuses_and_trains_as_eager",)),
    "norm_recomputed_output_held": Mutant(
        "a norm chain's backward holds a recomputed conv output through its conv's backward",
        (("autograd/norm_chain.py", "    del out, yv, pv, graph, got, act_out, wanted\n",
          "    del out, yv, pv, graph, got, act_out\n"),),
        ("tests/test_norm_memory_model.py::test_replayed_backward_is_the_measured_one",)),
    "norm_recomputed_act_beside_norm": Mutant(
        "a norm chain's backward recomputes a ReLU-family activation beside the norm's output, not over it",
        (("autograd/norm_chain.py", "                a = spec.act(_alias(z), inplace=True)\n",
          "                a = spec.act(z)\n"),),
        ("tests/test_norm_memory_model.py::test_recomputed_relu_is_written_over_the_norm_output",)),
    "norm_recomputed_act_through_detach": Mutant(
        "the activation written over the norm's output through detach(): the view's grad_fn is rebuilt",
        (("autograd/norm_chain.py", "                a = spec.act(_alias(z), inplace=True)\n",
          "                a = spec.act(z.detach(), inplace=True)\n"),),
        ("tests/test_norm_memory_model.py::test_recomputed_relu_is_written_over_the_norm_output",)),
    "norm_replay_act_beside_norm": Mutant(
        "the planner's replay allocates the recomputed activation beside the norm's output",
        (("autograd/norm_chain_memory.py", "            mem.rename((\"z\", i), out)\n",
          "            mem.alloc(out, n)\n            mem.free((\"z\", i))\n"),),
        ("tests/test_norm_memory_model.py::test_replayed_backward_is_the_measured_one",)),
    "norm_recompute_not_reused": Mutant(
        "a norm chain's backward recomputes a layer's norm again instead of using the graph its input's rebuild made",
        (("autograd/norm_chain.py", "    graph = rb.pending.pop(i, None)\n", "    graph = rb.pending.pop(i, None) and None\n"),),
        ("tests/test_norm_chain_ops.py::test_converted_step_dispatches_eager_ops_plus_one_recompute"
         "[GroupNorm-SiLU pre-bf16-autocast-cpu]",)),
    "norm_layer_norm_rebuilt_twice": Mutant(
        "a norm before a dropped conv is recomputed without a graph for the next rebuild and again with it, "
        "where its conv may not drop its rebuilt input",
        (("autograd/norm_chain.py", "            if k == i - 2 and norm_once(self.specs[k], self.specs[k + 1]):",
          "            if False and norm_once(self.specs[k], self.specs[k + 1]):"),),
        ("tests/test_norm_chain_ops.py::test_a_layer_norm_before_a_dropped_conv_is_recomputed_once[float32-cpu]",)),
    "norm_replay_layer_norm_rebuilt_twice": Mutant(
        "the planner's replay drops a norm's rebuilt output where the backward keeps it for the next conv",
        (("autograd/norm_chain_memory.py", "            once = m == i - 2 and self.norm_once(m)",
          "            once = False and self.norm_once(m)"),),
        ("tests/test_norm_memory_model.py::test_a_layer_norm_kept_for_a_dropped_conv_is_priced_for_every_plan",)),
    "norm_once_ignores_may_drop": Mutant(
        "a norm before a dropped conv is kept for the conv's backward even where the plan lets the chain drop it "
        "(the step peaks above the planner's prediction)",
        (("autograd/norm_chain.py",
          "    return spec.norm is not None and not spec.tail and spec.act.is_identity and not after.may_drop\n",
          "    return spec.norm is not None and not spec.tail and spec.act.is_identity\n"),),
        ("tests/test_norm_memory_model.py::test_a_layer_norm_kept_for_a_dropped_conv_is_priced_for_every_plan",)),
    "norm_conv_input_copied": Mutant(
        "a norm chain's conv backward copies its rebuilt input even where it has the conv's dtype",
        (("autograd/norm_chain.py", "    xin = (spec.conv.pad_input(x) if i > 0 else x).to(w.dtype)\n",
          "    xin = (spec.conv.pad_input(x) if i > 0 else x).to(w.dtype, copy=True)\n"),),
        ("tests/test_norm_chain_ops.py::test_converted_step_dispatches_eager_ops_plus_one_recompute"
         "[InstanceNorm-LeakyReLU post-bf16-autocast-cpu]",)),
    "engine_grad_ignores_subclasses": Mutant(
        "the direct engine call of a norm chain's backward skips a tensor subclass's __torch_function__",
        (("_compat.py", "    if _engine_run_backward is None or any(type(t) is not torch.Tensor for t in (output, grad, *inputs)):\n",
          "    if _engine_run_backward is None:\n"),),
        ("tests/test_norm_chain_ops.py::test_engine_grad_is_autograd_grad",)),
    "norm_conv_runs_once": Mutant(
        "the planner counts a norm chain's recomputed conv once, however often its backward runs it",
        (("autograd/norm_chain_memory.py", "            runs[i] += has_conv[i]\n", "            runs[i] = int(has_conv[i])\n"),),
        ("tests/test_norm_conv_runs.py",)),
    "norm_forward_moments_as_gaps": Mutant(
        "moments inside a norm chain's forward count everything the chain keeps (as gaps)",
        (("passes/plan/plan_inputs.py", "        if owner is None or not self.norm[owner]:\n", "        if True:\n"),),
        ("tests/test_norm_forward_moments.py::test_predicted_step_peak_is_the_measured_one_for_every_plan",)),
    "fold_takes_shape_specialised_graph": Mutant(
        "fold installs the graph of a module traced only with its real shapes even where its children fold alone",
        (("passes/fold/api.py", "        if not own_code_joins_a_batchnorm(traced.gm, module, prefix):",
          "        if False:"),),
        ("tests/test_upcat_pattern.py::test_folded_upcat_pattern_exports_with_dynamic_batch_and_spatial_sizes",)),
    "jit_isinstance_hazard": Mutant(
        "torch.jit.isinstance on a computed tensor is a trace hazard again (MONAI's UpCat left opaque)",
        (("passes/tracing/hazards.py", "        if real is not None:\n", "        if False:\n"),),
        ("tests/test_upcat_pattern.py",)),
    "jit_isinstance_list_of_proxies": Mutant(
        "torch.jit.isinstance on a list of traced tensors asks the proxies themselves (answers False)",
        (("passes/tracing/hazards.py", "        if not any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves(obj)):",
          "        if not isinstance(obj, fx.Proxy):"),),
        ("tests/test_upcat_pattern.py::test_jit_isinstance_on_computed_tensors_is_answered_without_shapes",)),
    "jit_isinstance_trusts_opaque_outputs": Mutant(
        "torch.jit.isinstance takes what an opaque module returned for a tensor (a dict answered as a tensor)",
        (("passes/tracing/hazards.py", "    if name in getattr(tracer, \"opaque\", {}) or name in getattr(tracer, \"hooked\", {}):\n        return False\n",
          ""),),
        ("tests/test_upcat_pattern.py::test_jit_isinstance_on_what_an_opaque_module_returned_is_a_hazard",)),
    "norm_end_layer_prelu_slot": Mutant(
        "a norm chain's end layer conv -> PReLU reads its PReLU weight as if the layer had norm slots",
        (("autograd/norm_chain.py", "return 2 * (spec.conv is not None) + (k if spec.norm is not None else k - 2)",
          "return 2 * (spec.conv is not None) + k"),),
        ("tests/test_norm_chain_end_prelu.py::test_an_end_layer_with_a_prelu_trains_as_eager[False-recompute_bn]",)),
    "rms_graph_maps_unpriced": Mutant(
        "the RMSNorm row says its graph holds no normalised input (the planner's replay one map short)",
        (("functional/norms.py", "graph_maps=lambda call, weight: int(weight),", "graph_maps=lambda call, weight: 0,"),),
        ("tests/test_rms_norm.py::test_memory_model_is_the_measured_one[normalize_gs-relu-recompute_bn]",)),
    "rms_scale_product_beside": Mutant(
        "F.normalize's product by the scale made beside its operand (a map more than the row says)",
        (("functional/norms.py", "return out if s is None else out.mul_(s)", "return out if s is None else out * s"),),
        ("tests/test_rms_norm.py::test_memory_model_is_the_measured_one[normalize_gs-relu-recompute_conv]",)),
    "rms_scale_gain_order": Mutant(
        "an RMSNorm's '* scale * g' computed as '* g * scale' (the same formula, rounded otherwise)",
        (("functional/norms.py", "        if form == \"normalize_gs\":\n", "        if True:\n"),),
        ("tests/test_rms_norm.py::test_each_spelling_runs_its_own_ops_bit_for_bit[normalize_sg]",)),
    "rms_normalize_as_rsqrt": Mutant(
        "F.normalize's clamp of the norm by eps taken for rsqrt(mean square + eps)",
        (("functional/norms.py", "    if form.startswith(\"normalize\"):\n", "    if False:\n"),),
        ("tests/test_rms_norm.py::test_normalize_clamps_the_norm_where_the_others_add_eps",)),
    "hand_global_norm_any_rank": Mutant(
        "statistics over dims 1, 2, ... become a GroupNorm whatever the input's rank",
        (("passes/bn/hand_layer_norms.py", "return F.group_norm if known == len(dims) + 1 else None",
          "return F.group_norm"),),
        ("tests/test_norm_hand_layer_norms.py::test_transposed_look_alikes_are_left_as_written[PartialStats]",)),
    "channel_layer_norm_transpose_any_rank": Mutant(
        "a transpose(1, 2) around a LayerNorm is taken for the channels-last permute at any rank",
        (("passes/bn/norm_sites.py", "_swaps_1_and_2(pair) and known_rank(node.args[0], gm) == 3:", "_swaps_1_and_2(pair):"),),
        ("tests/test_norm_transposed_layer_norms.py::test_a_4d_transpose_is_left_as_written[False]",)),
    "float32_difference_not_decided_in_float64": Mutant(
        "a float32 difference beyond the allowance stands (no float64 decision): a rounding-only rewrite is refused",
        (("passes/check/step.py", "    del ref, new\n    pair.clear()\n", "    return found\n"),),
        ("tests/test_check_float64_decision.py::test_a_rewrite_off_by_rounding_only_converts_whole_and_fused",)),
    "float64_decision_accepts_any_difference": Mutant(
        "the float64 decision accepts a rewrite that differs in float64 too (a wrong formula)",
        (("passes/check/step.py", "    if not same.ok:\n        why =", "    if False:\n        why ="),),
        ("tests/test_check_float64_decision.py::test_a_rewrite_that_is_wrong_in_float64_too_is_refused",)),
    "float64_decision_without_the_rewrite": Mutant(
        "a float64 step bit-identical to eager's (the rewrite did not run on the copy) decides",
        (("passes/check/step.py", "elif not ran or same.max_abs_diff == 0:", "elif not ran:"),),
        ("tests/test_check_float64_decision.py::test_a_float64_copy_whose_rewrite_does_not_run_decides_nothing",)),
    "norm_chain_conv_backward_in_one_call": Mutant(
        "a norm chain's convolution backward in one call again: the weight kernel's scratch on top of grad_x",
        (("autograd/norm_chain.py", "                               weight_first=xin.device.type == \"cpu\")\n",
          "                               weight_first=False)\n"),),
        ("tests/test_norm_allocator_peak.py::test_small_basic_unet_steps_within_half_of_eager_by_the_allocator",)),
    "conv_backward_weight_first_ignored": Mutant(
        "conv_backward(weight_first=True) runs one call (grad_x first, as ATen does)",
        (("functional/conv.py", "    if weight_first and mask[0] and mask[1] and not spec.is_linear:",
          "    if False:"),),
        ("tests/test_norm_allocator_peak.py::test_weight_first_conv_backward_is_the_same_bits_at_a_lower_high_water_mark",)),
    "lean_pool_int64_indices": Mutant(
        "a lean max pool keeps ATen's int64 indices (twice the bytes)",
        (("functional/pool.py", "    return indices.to(torch.int32) if indices.dtype", "    return indices if indices.dtype"),),
        ("tests/test_lean_pools.py::test_keeps_the_indices_not_the_input",)),
    "lean_pool_frees_indices_of_a_kept_graph": Mutant(
        "a lean max pool frees its int32 indices in backward even where the graph is retained",
        (("autograd/pool.py", "            if not keeping_graph():\n                free_storage(indices)\n",
          "            free_storage(indices)\n"),),
        ("tests/test_lean_pools.py::test_int32_indices_kept_for_a_retained_graph_and_let_go_otherwise",)),
    "check_statistics_copies_kept": Mutant(
        "the check's eager step keeps the snapshots' copies of the statistics it leaves unwritten (none lent)",
        (("passes/check/buffer_copies.py", "    return held is not None and held[0] is b and same_bits(b, held[1])",
          "    return False"),),
        (_PEAK_AT_BATCH,)),
    "check_eager_outputs_held": Mutant(
        "the check's eager step holds its outputs through the backward",
        (("passes/check/eager_reference.py", "        del out, outs\n", "        del out\n"),),
        (_PEAK_AT_BATCH,)),
    "check_norms_not_quietened": Mutant(
        "the check's eager step lets the BatchNorms write their statistics (so no copy can be lent)",
        (("passes/check/quiet_norms.py", "        m.track_running_stats = flag\n", "        pass\n"),),
        (_PEAK_AT_BATCH,)),
    "check_lent_copy_written_unseen": Mutant(
        "a buffer written while its copies are lent goes unseen (the model left changed)",
        (("passes/check/buffer_copies.py", "    if moved:\n        raise", "    if False:\n        raise"),),
        ("tests/test_check_eager_reference.py::test_a_copy_is_lent_only_while_its_buffer_has_its_bits_and_a_write_in_the_block_is_refused",)),
    "check_lends_changed_copies": Mutant(
        "a copy is lent although its buffer changed since it was taken (the old bits lost)",
        (("passes/check/buffer_copies.py", "held[0] is b and same_bits(b, held[1])", "held[0] is b"),),
        ("tests/test_check_eager_reference.py::test_a_copy_is_lent_only_while_its_buffer_has_its_bits_and_a_write_in_the_block_is_refused",
         "tests/test_check_eager_reference.py::test_convert_leaves_the_state_where_a_parent_writes_its_batchnorms_statistics")),
    "check_eager_buffers_from_the_quiet_step": Mutant(
        "eager's buffers after the step are read with the statistics unwritten (eager's reference moves none)",
        (("passes/check/eager_reference.py", "    with StateSnapshot(module), torch.no_grad():\n",
          "    with StateSnapshot(module), torch.no_grad(), statistics_unwritten(module):\n"),),
        ("tests/test_check_eager_reference.py::test_the_reference_is_one_eager_step_bit_for_bit_and_the_state_is_as_it_was",)),
    "check_recompute_in_backward_unseen": Mutant(
        "a backward that runs a quietened BatchNorm again (a checkpoint) is taken for one that moves no statistics",
        (("passes/check/eager_reference.py", "if quiet.flag.reads != reads or any(", "if any("),),
        ("tests/test_check_eager_reference.py::test_a_backward_that_runs_a_batchnorm_again_takes_the_step_whole",
         "tests/test_capture_checkpoint.py::test_checkpoint_keeps_eager_running_statistics")),
    "slices_one_sample_only": Mutant(
        "a model that refuses one sample is recorded at the example batch (no second pair of slices)",
        (("passes/plan/sliced_measure.py", "SLICE_PAIRS = ((1, 2), (2, 3))", "SLICE_PAIRS = ((1, 2),)"),),
        ("tests/test_convert_steps.py::test_a_model_that_refuses_one_sample_is_recorded_at_two_and_three",)),
    "slices_never_one_sample": Mutant(
        "the planner's recorded steps never run on one sample (2 and 3 only)",
        (("passes/plan/sliced_measure.py", "SLICE_PAIRS = ((1, 2), (2, 3))", "SLICE_PAIRS = ((2, 3),)"),),
        ("tests/test_convert_steps.py::test_convert_with_example_inputs_runs_every_step_on_slices",)),
    "check_slice_despite_shape_guards": Mutant(
        "convert's check runs on a slice of the batch where a graph is guarded on its input shapes (a graph for the batch)",
        (("passes/check/slice_check.py", "    if any(fwd is not None and _shape_guarded(fwd.defaults)",
          "    if False and any(fwd is not None and _shape_guarded(fwd.defaults)"),),
        ("tests/test_convert_steps.py::test_a_graph_traced_with_real_shapes_is_checked_at_the_example_batch",)),
    "check_slice_difference_stands": Mutant(
        "a difference on the slice of the batch is the check's verdict (not decided at the example batch)",
        (("passes/check/slice_check.py", "        if result is not None and result.ok and [f.fallback",
          "        if result is not None and [f.fallback"),),
        ("tests/test_convert_steps.py::test_a_difference_on_the_slice_is_decided_at_the_example_batch",)),
    "check_slice_refusal_raises": Mutant(
        "a model that refuses the slice of the batch makes convert raise (not checked at the example batch)",
        (("passes/check/slice_check.py", "        except Exception:  # noqa: BLE001 - a model that refuses the slice",
          "        except ZeroDivisionError:  # noqa: BLE001 - a model that refuses the slice"),),
        ("tests/test_convert_steps.py::test_a_model_that_refuses_the_slice_is_checked_at_the_example_batch",)),
    "slices_shapes_at_of_a_refused_check": Mutant(
        "the batch of a refused (undone) check counts for the layers' shapes: parts checked on slices are planned at the batch",
        (("passes/convert/api.py", "        if not why:  # a refused rewrite is undone", "        if True:  # a refused rewrite is undone"),),
        ("tests/test_convert_steps.py::test_parts_checked_on_slices_after_a_refused_whole_keep_the_planner_on_slices",)),
    "slices_layer_shapes_of_the_check_slice": Mutant(
        "after a check on a slice the layers keep the slice's shapes (not the example batch's, on the planner's lines)",
        (("passes/plan/sliced_measure.py", "    if not _extrapolated(seen[0], seen[1], pair, batch) or not",
          "    if False or not"),),
        ("tests/test_convert_steps.py::test_the_plan_and_report_are_those_of_a_check_at_the_example_batch",)),
    "autocast_cache_kept_after_a_fake_trace": Mutant(
        "autocast's cache keeps the fake casts a shape capture made of the real weights",
        (("passes/graph/shape_capture.py", "            torch.clear_autocast_cache()\n", "            pass\n"),),
        ("tests/test_autocast_variant_cache.py::test_steps_under_autocast_after_a_float32_convert_are_eager_autocasts",)),
    "check_reference_in_two_runs_on_sharded_parameters": Mutant(
        "the check's eager reference is taken in two runs on a model whose parameters are DTensors (FSDP2)",
        (("passes/check/eager_reference.py", "    if any(type(p.data) is not Tensor for p in params):\n        return None",
          "    if False:\n        return None"),),
        ("tests/test_fsdp2.py::test_fsdp2_matches_eager_fsdp2_fused",)),
    "allocator_meter_start_before_zero_grad": Mutant(
        "the allocator (CUDA) meter reads its start when it is built, before the previous step's gradients are freed",
        (("memory/allocator_meter.py", "        self.start = 0\n", "        self.start = counters.allocated()\n"),
         ("memory/allocator_meter.py", "        self.start = self.counters.allocated()\n        self.counters.reset_peak()\n",
          "")),
        ("tests/test_max_batch_bound.py::test_an_allocator_meter_starts_after_the_previous_gradients_are_freed",)),
    "max_batch_copy_let_go_not_collected": Mutant(
        "max_batch collects only where a copy is still held: one let go (prediction off) lives beside the next",
        (("batch_search.py", "        if self.copies:  # Note:", "        if self.held:  # Note:"),),
        ("tests/test_max_batch_bound.py::test_a_copy_let_go_is_freed_before_the_next_is_made",)),
    "max_batch_inputs_outside_the_memory": Mutant(
        "max_batch's steps stopped at the room the resident bytes leave, the batch of inputs not in the memory",
        (("batch_search.py", "        room = self.usable - self.before(b)", "        room = self.usable - self.resident"),),
        ("tests/test_max_batch_bound.py::test_answering_holds_no_tensors_above_the_limit",)),
    "lean_meter_forgets_modules_outside_the_model": Mutant(
        "the lean meter's module hook counts nothing: a layer held outside the registered children never counts its weights",
        (("_compat.py", "                self._track_module_params_and_buffers(module, install_grad_hooks=False)\n",
          "                pass\n"),),
        ("tests/test_lean_meter.py::test_a_module_held_outside_the_model_is_counted_once_it_runs",
         "tests/test_lean_meter.py::test_every_point_is_the_one_torchs_module_hooks_give")),
    "plain_walk_counts_first_output_only": Mutant(
        "the meter's walk without pytree counts only the first tensor an operator returns (a batch norm's statistics missed)",
        (("_compat.py", "            for v in tree:\n                if type(v) in _PLAIN_TENSORS:\n                    fn(v)\n",
          "            for v in tree[:1]:\n                if type(v) in _PLAIN_TENSORS:\n                    fn(v)\n"),),
        ("tests/test_lean_meter.py::test_every_point_is_the_one_torchs_module_hooks_give",)),
    "module_tracker_never_in_backward": Mutant(
        "the module tracker registers only the hooks that hold gradients even when asked to name the backward's modules",
        (("memory/mod_tracking.py", "        if not backward and not _may_hold(", "        if not _may_hold("),),
        ("tests/test_lean_meter.py::test_every_point_is_the_one_torchs_module_hooks_give",)),
    "forward_only_tracker_drops_holding_hooks": Mutant(
        "the planner's module tracker drops the input hooks that hold gradients too (a DenseNet layer's backward measured lower)",
        (("memory/mod_tracking.py", "    return mode == \"all\" and sum(", "    return False and sum("),),
        ("tests/test_lean_meter.py::test_every_point_is_the_one_torchs_module_hooks_give",)),
    "stopped_backward_not_drained": Mutant(
        "a step stopped in its backward leaves the engine's pending nodes (and their saved tensors) until the next backward",
        (("memory/timelines.py", "            _drain_autograd()  # Note:", "            pass  # Note:"),),
        ("tests/test_max_batch_bound.py::test_a_step_stopped_in_backward_leaves_nothing_allocated",)),
    "stopped_step_kept_with_its_traceback": Mutant(
        "max_batch keeps a stopped step's exception with its traceback (its frames alive beside the next step)",
        (("batch_search.py", "return over.with_traceback(None)", "return over"),),
        ("tests/test_max_batch_bound.py::test_a_stopped_step_is_let_go_at_once",)),
    "split_length_from_code_only": Mutant(
        "a split's number of pieces read only from sizes listed in the code, not from a trace with real shapes",
        (("passes/tracing/trace.py", "    if isinstance(value, (list, tuple)):\n        return len(value)\n",
          "    if False:\n        return len(value)\n"),),
        ("tests/test_split_by_shape.py",)),
    "dtype_answered_float32": Mutant(
        "a traced value's dtype answered float32 whatever the real one (the dtype branch taken wrong)",
        (("passes/graph/shape_capture.py", "                return getattr(value, k)\n",
          "                return torch.float32 if k == \"dtype\" else getattr(value, k)\n"),),
        ("tests/test_dtype_eps_norms.py",)),
    "shape_guard_ignores_autocast": Mutant(
        "a capture with real inputs applied under any autocast state (the dtype guard not checked)",
        (("passes/graph/shape_capture.py", "if torch.is_autocast_enabled(d))", "if False)"),),
        (_DTYPE_BF16,)),
    "shape_guard_ignores_dtypes": Mutant(
        "a capture with real inputs applied to inputs of any dtype",
        (("passes/graph/shape_capture.py", "(tuple(t.shape), t.dtype, str(t.device))", "(tuple(t.shape), str(t.device))"),),
        (_DTYPE_BF16,)),
    "casts_dropped_whatever_the_dtype": Mutant(
        "every cast method dropped, also where it changes the traced dtype",
        (("passes/graph/noop_casts.py", "if dtype is None or node.args[0].meta.get(DTYPE) is not dtype:",
          "if dtype is None:"),),
        (_DTYPE_GAIN_CAST,)),
    "negative_dims_read_from_the_front": Mutant(
        "a reduction dim counted from the end made absolute as if counted from the front",
        (("passes/graph/absolute_dims.py", "fixed = [d % rank for d in dims]", "fixed = [abs(d) for d in dims]"),),
        ("tests/test_dtype_eps_norms.py",)),
    "isinstance_on_a_traced_piece_a_hazard": Mutant(
        "isinstance on a chunk's piece whose fake value is a tensor taken for a hazard (the block stays opaque)",
        (("passes/graph/trace_hazards.py", "or isinstance(proxy.node.meta.get(VALUE), torch.Tensor))", "or False)"),),
        (_DTYPE_ZERO_BIAS,)),
    "zero_adds_dropped_whatever_the_dtype": Mutant(
        "x + 0 dropped whatever the dtypes of x and of the sum",
        (("passes/graph/zero_adds.py", "    if not isinstance(x, fx.Node) or not isinstance(out, torch.dtype) or not out.is_floating_point:\n",
          "    if not isinstance(x, fx.Node):\n"),
         ("passes/graph/zero_adds.py", "    return x if x.meta.get(DTYPE) is out or type(zero) is int else None\n", "    return x\n")),
        (_DTYPE_ZERO_ADDS,)),
    "opaque_norms_not_traced_again": Mutant(
        "a module shaped like a norm left opaque by the symbolic trace is no reason to trace with real inputs",
        (("passes/convert/pipeline.py", "    failed = traced.opaque_to_retrace(module)\n",
          "    failed = traced.opaque_layers(module)\n"),),
        ("tests/test_dtype_eps_norms.py",)),
    "kernel_scratch_not_counted": Mutant(
        "max_batch's steps count no kernel scratch (the code before it was counted: the call goes over the memory)",
        (("memory/kernel_scratch.py", '    if call is None or call.device != "cpu":\n        return 0\n',
          '    if True:\n        return 0\n'),),
        ("tests/test_max_batch_scratch.py::test_the_call_stays_within_the_memory_by_the_cpu_allocator",)),
    "kernel_scratch_stride_term_for_stride_1": Mutant(
        "the input-sized buffer of a strided convolution's backward counted for stride 1 too",
        (("memory/kernel_scratch.py", "    extra = s * int(call.groups == 1", "    extra = int(call.groups == 1"),),
        ("tests/test_max_batch_scratch.py::test_the_eager_answer_is_the_largest_batch_whose_step_and_scratch_fit",)),
    "batch_norm_backward_scratch_dropped": Mutant(
        "BatchNorm's CPU backward takes no scratch in the table",
        (("memory/kernel_scratch.py", "if call.grad_input else 0", "if False else 0"),),
        ("tests/test_kernel_scratch.py::"
         "test_batch_norm_backward_takes_its_inputs_bytes_where_the_inputs_gradient_is_asked",)),
    "max_batch_plans_ignore_chain_scratch": Mutant(
        "max_batch's per-batch plans leave no room for the chains' kernel scratch (the prediction is then off)",
        (("batch_search.py", "            if len(scratch) == len(costs):", "            if False:"),),
        ("tests/test_max_batch_predict.py::test_confirmed_prediction_measures_the_answer_and_the_batch_above",)),
    "max_batch_walk_removed": Mutant(
        "a refuted prediction is measured at once, never walked",
        (("batch_search.py", "\nWALK = 3\n", "\nWALK = 0\n"),),
        ("tests/test_max_batch_predict.py::test_a_refuted_prediction_is_walked_to_the_measured_answer",)),
    "channel_linear_bias_dropped": Mutant(
        "a Linear on the channels (a LayerNorm -> Linear chain's end) runs without its bias",
        (("functional/conv.py", "        return channel_linear(x, weight, bias)\n", "        return channel_linear(x, weight, None)\n"),),
        ("tests/test_norm_linear.py::test_layer_norm_then_linear_fuses_and_trains_as_eager",)),
    "norm_chain_keeps_each_layer_output": Mutant(
        "a norm chain's forward keeps each activation's output (written over the norm's output) until backward",
        (("autograd/norm_chain.py", "        x = spec.act(z, inplace=True) if not _shares_storage(z, kept.get(i)) else spec.act(z)\n",
          "        x = spec.act(z, inplace=True) if not _shares_storage(z, kept.get(i)) else spec.act(z)\n"
          "        kept[-1 - i] = x\n"),),
        ("tests/test_norm_linear.py::test_the_step_peaks_lower_than_eager_by_the_maps_it_does_not_keep",)),
    "view_rank_taken_as_three": Mutant(
        "the rank a permute states read as 3 whatever its dims (a channels-last map's permutes written for 3-D)",
        (("passes/graph/value_rank.py",
          "        return len(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else len(dims) or None\n"
          "    if node.op == \"call_method\" and node.target in _SHAPES:",
          "        return 3\n    if node.op == \"call_method\" and node.target in _SHAPES:"),),
        ("tests/test_norm_linear.py::test_layer_norm_then_linear_fuses_and_trains_as_eager",)),
    "channel_linear_chain_eager_under_compile": Mutant(
        "a chain ending in a Linear on the channels runs as its modules under torch.compile (keeps eager's maps)",
        (("autograd/norm_chain_compiled.py",
          "               or (s.conv.channel_linear and i == last and s.norm is None and not s.tail and s.act.is_identity)\n",
          ""),),
        ("tests/test_norm_linear.py::test_torch_compile_fullgraph_keeps_what_the_chain_keeps",)),
    "norm_moved_past_any_permute": Mutant(
        "a LayerNorm moved past a permute that takes the channels away from last (a window partition's check dropped)",
        (("passes/convert/norm_linears.py", "        return dims[-1] in (len(dims) - 1, -1)\n", "        return True\n"),),
        ("tests/test_norm_linear.py::test_a_permute_that_moves_the_channels_keeps_the_norm_where_it_is",)),
    "last_resort_reads_hooks_on": Mutant(
        "the planner's last resort reads the fused step with the module tracker's backward hooks on (eager's without)",
        (("passes/plan/auto_plan.py", "measure_peak(converted, inputs, backward_modules=False).peak",
          "measure_peak(converted, inputs).peak"),),
        ("tests/test_lean_meter.py::test_convert_compares_eager_and_fused_peaks_read_by_one_meter",)),
    "compile_caveat_unreported": Mutant(
        "a norm chain that runs as eager modules under torch.compile says nothing of it in the report",
        (("nn/norm_chain.py", "        if compilable_norm_chain(specs):\n            return \"\"\n",
          "        if True:\n            return \"\"\n"),),
        ("tests/test_norm_chain_dropout_report.py::test_the_report_says_such_a_chain_runs_as_eager_modules_under_compile",)),
    "fake_errors_logged": Mutant(
        "the shape trace's failed fake runs reach torch's ERROR log (no filter around the fake run)",
        (("passes/graph/shape_capture.py", "torch.no_grad(), fake_errors_quiet(), self._fake_mode:",
          "torch.no_grad(), self._fake_mode:"),),
        ("tests/test_quiet_fake.py",)),
    "movedim_any_dims": Mutant(
        "any movedim read as moving the channels last (a LayerNorm over the height taken for a channel norm)",
        (("passes/bn/norm_sites.py", "    if _movedim_pair(node) == (1, -1):\n", "    if _movedim_pair(node) is not None:\n"),),
        ("tests/test_norm_movedim_layer_norms.py::test_a_movedim_of_another_dimension_is_left_as_written",)),
    "norm_dropout_redrawn": Mutant(
        "a per-sample norm chain's dropout re-drawn from the global stream instead of replayed in backward",
        (("autograd/norm_chain_tail.py", "dropout_draw(op, z, owned, capture, states)",
          "dropout_draw(op, z, owned, capture, None)"),),
        ("tests/test_norm_chain_dropout.py::test_a_dropout_in_a_norm_chain_runs_fused_as_eager[post-dropout-recompute_conv]",
         "tests/test_norm_chain_dropout.py::test_a_dropout_in_a_norm_chain_runs_fused_as_eager[preact-dropout-recompute_bn]")),
    "norm_dropout_redrawn_double_backward": Mutant(
        "a per-sample norm chain's differentiable backward re-draws its dropouts instead of replaying forward's",
        (("autograd/norm_chain.py", "norm_chain_reference(x, ps, specs, stats, ctx.draws)",
          "norm_chain_reference(x, ps, specs, stats)"),),
        ("tests/test_norm_chain_dropout.py::test_a_differentiable_backward_replays_forwards_masks",)),
}


def apply_mutant(name: str, dest: str) -> str:
    """Copy ``src/convbn`` under ``dest`` with mutant ``name`` applied; returns the directory to
    put first on ``PYTHONPATH``. Raises ``ValueError`` when an edit no longer applies."""
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)}")
    pkg = os.path.join(dest, "convbn")
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, old, new in MUTANTS[name].edits:
        path = os.path.join(pkg, rel)
        with open(path) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            raise ValueError(f"mutant {name!r}: expected the text to edit exactly once in src/convbn/{rel}, "
                             f"found it {n} times; update the mutant's edit in scripts/mutants.py:\n{old}")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    return dest


def _env(pythonpath: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pythonpath, os.path.join(ROOT, "scripts")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_PYTEST_ARGS = ("-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=")


def run_mutant(name: str, tests: Optional[Sequence[str]] = None, extra: Sequence[str] = (),
               timeout: float = 3600, runner: Optional["WarmPytest"] = None) -> Tuple[bool, float, str]:
    """Run ``tests`` (default: the mutant's subset) against mutant ``name``: in a fresh
    ``python -m pytest``, or in a process forked by ``runner`` (:class:`WarmPytest`).

    Returns:
        ``(killed, seconds, output tail)``: killed when pytest reports a failure (exit code 1).
    """
    tests = list(tests or MUTANTS[name].tests)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"convbn-mutant-{name}-") as tmp:
        path = apply_mutant(name, tmp)
        args = [*_PYTEST_ARGS, *tests, *extra]
        if runner is not None:
            code, out = runner.run(path, args, timeout)
        else:
            proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=_env(path),
                                  capture_output=True, text=True, timeout=timeout)
            code, out = proc.returncode, proc.stdout + proc.stderr
    if code not in (0, 1):
        raise RuntimeError(f"mutant {name!r}: pytest could not run the tests (exit {code}):\n{out[-3000:]}")
    return code == 1, time.perf_counter() - t0, out[-2000:]


class WarmPytest:
    """Runs pytest against a package copy in a child forked from a server process that has
    imported torch, pytest and hypothesis, and nothing of convbn (Note: [warm mutant runs]).

    Use as a context manager; :meth:`run` returns ``(exit code, output)`` like ``python -m pytest``
    with ``PYTHONPATH`` the copy and ``scripts/``, run in the repository root.
    """

    def __init__(self) -> None:
        self._server: Optional[subprocess.Popen] = None

    def __enter__(self) -> "WarmPytest":
        env = _env(os.path.join(ROOT, "scripts"))
        self._server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], cwd=ROOT, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stdin.close()  # type: ignore[union-attr]
            self._server.wait(timeout=60)
            self._server = None

    def run(self, path: str, args: Sequence[str], timeout: float) -> Tuple[int, str]:
        if self._server is None:
            raise RuntimeError("WarmPytest.run outside its `with` block")
        with tempfile.NamedTemporaryFile("r", prefix="convbn-mutant-out-", suffix=".txt") as out:
            request = {"path": path, "args": list(args), "out": out.name, "timeout": int(timeout)}
            self._server.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
            self._server.stdin.flush()  # type: ignore[union-attr]
            reply = self._server.stdout.readline()  # type: ignore[union-attr]
            if not reply:
                raise RuntimeError(f"the warm pytest server stopped (exit {self._server.poll()})")
            return int(json.loads(reply)["code"]), out.read()


# Note: [warm mutant runs]
# Each mutant needs a process of its own (its copy of convbn is imported, and convbn registers
# torch custom ops, which cannot be undone), but most of such a process's cost is importing torch,
# pytest, hypothesis and (tests/conftest.py's) torchvision, about 4 s of CPU of the 5-7 s a small
# kill test takes. The server imports those once, as conftest would (the kill tests run in the
# process state they always ran in: some depend on it), and forks a child per mutant; the child puts the copy first on sys.path (and on
# PYTHONPATH, for processes the tests start), runs pytest.main in the repository root with its
# output in a file, and exits with pytest's code. A child killed by its alarm (the hang guard)
# exits by a signal: a code other than 0 or 1, an error as a crashed pytest is.
def _serve() -> int:
    import signal
    import traceback

    import hypothesis  # noqa: F401 - imported once, for every child
    import pytest
    import torch  # noqa: F401

    sys.path.insert(0, os.path.join(ROOT, "tests"))  # what tests/conftest.py imports in every pytest, once
    try:
        from zoo import import_torchvision_without_fake_kernels

        import_torchvision_without_fake_kernels()
    except ImportError:  # torchvision not installed
        pass
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                signal.alarm(req["timeout"])
                paths = [req["path"], os.path.join(ROOT, "scripts")]
                sys.path[:0] = paths
                os.environ["PYTHONPATH"] = os.pathsep.join(paths)
                os.chdir(ROOT)
                code = int(pytest.main(req["args"]))
            except BaseException:  # noqa: BLE001 - any failure to run is an error, not a kill
                traceback.print_exc()
                code = 3
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps({"code": code if code >= 0 else 128 - code}) + "\n")
        sys.stdout.flush()
    return 0


def measure(name: str = "fused_forward_eager", workers: int = 2, extra: Sequence[str] = ()) -> Dict[str, float]:
    """The default suite against mutant ``name`` with ``convert_probe`` recording, per test,
    whether it called ``convbn.convert`` (or built a ``FusedChain``) and whether it failed."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"convbn-measure-{name}-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        path = apply_mutant(name, src) if name != "none" else os.path.join(ROOT, "src")
        out_dir = os.path.join(tmp, "probe")
        os.makedirs(out_dir)
        env = _env(path)
        env["CONVBN_PROBE_DIR"] = out_dir
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "convert_probe",
               *(["-n", str(workers)] if workers > 1 else []), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        rows: Dict[str, Dict[str, bool]] = {}
        for fn in glob.glob(os.path.join(out_dir, "*.jsonl")):
            with open(fn) as f:
                for line in f:
                    for k, v in json.loads(line).items():
                        r = rows.setdefault(k, {"convert": False, "chain": False, "failed": False})
                        for key in r:
                            r[key] = r[key] or v.get(key, False)
    conv = [k for k, r in rows.items() if r["convert"]]
    any_ = [k for k, r in rows.items() if r["convert"] or r["chain"]]
    res = {
        "tests": len(rows),
        "convert_tests": len(conv),
        "convert_failed": sum(rows[k]["failed"] for k in conv),
        "chain_or_convert_tests": len(any_),
        "chain_or_convert_failed": sum(rows[k]["failed"] for k in any_),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    res["fraction_failed"] = round(res["convert_failed"] / max(1, res["convert_tests"]), 4)
    res["fraction_failed_chain_or_convert"] = round(res["chain_or_convert_failed"] / max(1, len(any_)), 4)
    survivors = sorted(k for k in conv if not rows[k]["failed"])
    print("\n".join(l for l in proc.stdout.splitlines() if l.startswith(("FAILED", "ERROR")))[-20000:])
    print(proc.stdout[-300:])
    print(json.dumps(res, indent=1))
    if survivors:
        print(f"{len(survivors)} convert-calling tests pass against mutant {name}:")
        for k in survivors:
            print("   ", k)
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mutants", nargs="*", help=f"mutants to run (default: all): {', '.join(MUTANTS)}")
    p.add_argument("--tests", nargs="+", help="pytest arguments to run instead of each mutant's subset")
    p.add_argument("--measure", action="store_true",
                   help="run the whole default suite against the mutant (default fused_forward_eager) and print "
                        "the fraction of convert-calling tests that fail")
    p.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers for --measure")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # WarmPytest's server
    args = p.parse_args(argv)
    if args.serve:
        return _serve()
    if args.measure:
        res = measure(args.mutants[0] if args.mutants else "fused_forward_eager", args.workers, args.tests or ())
        return 0 if res["fraction_failed"] >= 0.9 else 1
    names = args.mutants or list(MUTANTS)
    t0 = time.perf_counter()
    survived: List[str] = []
    for name in names:
        killed, secs, out = run_mutant(name, args.tests)
        print(f"{'killed  ' if killed else 'SURVIVED'} {name:<26} {secs:6.1f} s  {MUTANTS[name].doc}", flush=True)
        if not killed:
            survived.append(name)
            print("   " + out.strip().splitlines()[-1] if out.strip() else "")
    print(f"{len(names) - len(survived)} of {len(names)} mutants killed in {time.perf_counter() - t0:.1f} s"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
