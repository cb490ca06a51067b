"""A converted module that changed after ``convert`` is captured again, or runs its own forward.

Note: [captured again when the model changes]
Each forward ``convert`` installs carries :class:`~convbn.passes.check.guards.Guards` (what its
trace assumed: module identities, classes, plain attributes) and a :class:`Recapture`. When a
guard fails on a call (a drop-path rate on a schedule, a conv re-initialised by assignment,
a BatchNorm swapped for ``nn.Identity`` or ``nn.SyncBatchNorm``, a wrapper that swaps the
class), that module alone is converted again for what it is now, exactly as ``convert``
without ``example_inputs`` converts it: its installed forwards are removed, it is traced,
matched and rewritten again, the chains are planned on their first call, and the new graph
checks itself against the module's own forward on that call. The report's entries for that
module are replaced by the new ones, and one message says what changed and what runs now.

Like ``torch.compile``'s recompile limit, a module that changes more than
:data:`MAX_RECAPTURES` times (a value set on every step) stops being captured again: its own
forward (unfused) runs from then on, and the report and a message say so; so does a module
whose new capture fails.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch.fx as fx
from torch import nn

from ...nn.chain import FusedChain
from ..check.guards import Guards
from ..graph.graph_module import GraphForward, installed, uninstall
from ..report.convert_report import ConvertReport
from ..report.outcome import norm_module_names, unreached

__all__ = ["MAX_RECAPTURES", "Recapture", "attach_guards", "refuse_flat_parameters"]

#: how many times one module is captured again before its own forward runs for good
MAX_RECAPTURES = 8

#: (module, prefix, report to fill, the model's report, strategy, chain, count) -> None:
#: convert ``module`` again
Reconvert = Callable[[nn.Module, str, ConvertReport, ConvertReport, str, bool, int], None]


def attach_guards(fwd: GraphForward, gm: fx.GraphModule, prefix: str, recapture: "Recapture") -> None:
    """Give ``fwd`` (just installed from ``gm``) its guards and what to do when one fails.

    Args:
        fwd: the installed forward (its ``owner`` is the converted module).
        gm: the rewritten graph it runs.
        prefix: ``owner``'s qualified name in the converted model plus ``"."`` (``""`` at the root).
        recapture: the handler called with what changed.
    """
    owned = dict(fwd.owner.named_modules())
    called = [str(n.target) for n in gm.graph.nodes
              if n.op in ("call_module", "get_attr") and str(n.target) in owned]
    at_call = [e for c in gm.modules() if isinstance(c, FusedChain) for l in c.layers for e in l.tail
               if isinstance(e, nn.Module)]
    fwd.guards = Guards(fwd.owner, prefix, called, at_call)
    fwd.on_change = recapture


class Recapture:
    """What a failed guard of one installed forward does (Note: [captured again when the model
    changes]): convert its module again, or give up and run the module's own forward.

    Args:
        report: the converted model's report (updated in place).
        prefix: the module's qualified name plus ``"."`` (``""`` at the root).
        strategy, chain: as given to ``convert``.
        count: how many times this module was captured again already.
        reconvert: converts one module into a report (``convert``'s own pipeline run again:
            :func:`convbn.passes.convert.pipeline.reconvert`).
    """

    def __init__(self, report: ConvertReport, prefix: str, strategy: str, chain: bool, count: int,
                 reconvert: Reconvert) -> None:
        self.report = report
        self.prefix = prefix
        self.strategy = strategy
        self.chain = chain
        self.count = count
        self.reconvert = reconvert

    def __call__(self, fwd: GraphForward, what: str) -> bool:
        """Capture ``fwd.owner`` again because ``what`` changed; ``False``: its own forward runs."""
        owner = fwd.owner
        label = self.prefix.rstrip(".") or type(owner).__name__
        if self.count >= MAX_RECAPTURES:
            return self._give_up(owner, f"{what} after convert; {label} changed {self.count + 1} times, past "
                                 f"the limit of {MAX_RECAPTURES} new captures")
        fresh = ConvertReport(strategy=self.report.strategy)
        _remove_installed(owner)
        try:
            self.reconvert(owner, self.prefix, fresh, self.report, self.strategy, self.chain, self.count + 1)
        except Exception as exc:  # noqa: BLE001 - the new capture fails: the module's own forward runs
            _remove_installed(owner)
            return self._give_up(owner, f"{what} after convert; capturing {label} again raised "
                                 f"{type(exc).__name__}: {exc}")
        _merge(self.report, self.prefix, fresh, owner)
        n = fresh.num_chains
        done = f"{n} chain{'s' if n != 1 else ''} fused" if n else "nothing fused now"
        message = f"{what} after convert; re-captured {label} ({done})"
        self.report.changes.append(message)
        warnings.warn(f"convbn: {message}", UserWarning, stacklevel=4)
        return True

    def _give_up(self, owner: nn.Module, why: str) -> bool:
        _remove_installed(owner)
        fresh = ConvertReport(strategy=self.report.strategy)
        for names in norm_module_names(owner):
            fresh.leave(self.prefix + names[0] if names[0] else self.prefix.rstrip("."),
                        f"runs its module's original forward: {why}")
        _merge(self.report, self.prefix, fresh, owner)
        message = f"{why}; running the original (unfused) {type(owner).__name__} forward from now on"
        self.report.changes.append(message)
        warnings.warn(f"convbn: {message}", RuntimeWarning, stacklevel=4)
        return False


def refuse_flat_parameters(model: nn.Module) -> None:
    """Raise where FSDP1 (``FullyShardedDataParallel``) flattened ``model``'s parameters: the
    modules' own weights are views it swaps in and out, which a fused chain cannot follow.

    Raises:
        TypeError: naming the flat parameter and FSDP2.
    """
    try:
        from torch.distributed.fsdp import FlatParameter
    except ImportError:  # a torch built without distributed
        return
    flat = next((n for n, p in model.named_parameters() if isinstance(p, FlatParameter)), None)
    if flat is not None:
        raise TypeError(
            f"convbn cannot convert a model wrapped in FSDP1 (FullyShardedDataParallel): its parameter {flat!r} is "
            "a FlatParameter whose views replace the modules' weights. Use FSDP2 instead "
            "(torch.distributed.fsdp.fully_shard per block and on the root), before or after convert")


def _remove_installed(owner: nn.Module) -> None:
    """Remove every forward installed on ``owner`` and under it, with the modules it added
    (``convert`` forgets how to undo additions once the model is checked; they are listed)."""
    for m in owner.modules():
        fwd = installed(m)
        if fwd is None:
            continue
        undo = list(fwd.undo or ())
        known = {(id(p), n) for p, n, _, _ in undo}
        for target in fwd.added:
            path, _, name = target.rpartition(".")
            parent = m.get_submodule(path) if path else m
            if (id(parent), name) not in known and name in parent.__dict__:
                undo.insert(0, (parent, name, "", None))
        fwd.undo = undo
    uninstall(owner)


def _merge(report: ConvertReport, prefix: str, fresh: ConvertReport, owner: nn.Module) -> None:
    """Replace ``report``'s entries for the module at ``prefix`` by ``fresh``'s."""
    def outside(name: str) -> bool:
        return bool(prefix) and name != prefix[:-1] and not name.startswith(prefix)

    kept = [p for p in report.pairs if outside(p.bn or p.conv)]
    shift = max((p.chain for p in kept), default=-1) + 1
    for p in fresh.pairs:
        p.chain += shift
    report.pairs[:] = kept + fresh.pairs
    names = [[prefix + n for n in ns] for ns in norm_module_names(owner)]
    fresh.recorded += unreached(names, fresh.recorded, [m for m, _ in fresh.untraced], fresh.traced,
                                errors=dict(fresh.untraced))
    report.recorded[:] = [o for o in report.recorded if outside(o.batchnorm)] + fresh.recorded
    report.traced[:] = [t for t in report.traced if outside(t)] + fresh.traced
    report.untraced[:] = [u for u in report.untraced if outside(u[0])] + fresh.untraced
    report.validated[:] = [v for v in report.validated if outside(v)]
    report.lean_pools[:] = [p for p in report.lean_pools if outside(p)] + fresh.lean_pools
    for key in [k for k in report.shared_pieces if not outside(k)]:
        del report.shared_pieces[key]
    report.shared_pieces.update(fresh.shared_pieces)

