"""convbn.passes: the torch.fx passes, one package per role.

* ``graph/``  shared graph infrastructure: the tracer and its hazards, the in-place rewrite
  (``GraphForward``: a user's module keeps its object and class), hooks, shape-only uses,
  the conv / linear layers both passes recognise;
* ``bn/``     BatchNorm written any way: norm-act subclasses, frozen BatchNorms, functional
  calls, BatchNorm1d over a linear layer's tokens; ``sites.bn_call`` names each for both passes;
* ``convert/`` training: match Conv -> BN (-> tail) chains, shared heads, concatenation heads,
  rewrite them into ``FusedChain`` calls, lean pooling; ``convert.pipeline`` lists the stages in
  order (and runs them again on one module); ``convert.api`` holds ``convert`` / ``explain``;
* ``fold/``   inference: fold BatchNorm into a neighbouring conv / linear; ``fold.api`` holds ``fold``;
* ``plan/``   ``strategy="auto"``: the pure planner, the glue that measures chains for it, and
  ``chain_plans``: its flags made into each chain's frozen plan;
* ``check/``  validation with one tolerance rule and one normalisation of ``example_inputs``:
  the whole rewritten model against itself set aside (``step``), fold's sample inputs;
* ``report/`` ``BNOutcome`` (one per BatchNorm) and the two reports built from it.

Use ``convbn.convert`` / ``convbn.fold``; subpackages re-export nothing (their ``__init__``
stays empty so that importing one never imports another).
"""
