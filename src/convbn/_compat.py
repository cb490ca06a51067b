"""The one door to torch's private names and to torch APIs newer than the declared minimum.

# Note: [one door to private torch]
# convbn supports every torch from ``MINIMUM_TORCH`` on (pyproject's ``Requires-Dist``,
# docs/torch-versions.md). Everything it reads from torch that is private (a ``torch._*``
# module or function, a private attribute of a public module) or newer than that minimum is
# named here, and only here (tests/test_private_torch.py fails on any other file that
# imports or reads one). Each entry is found by a feature check (an import or ``hasattr``,
# never a comparison of version strings), names the first release that has it, and either
# has a working fallback or an ``available`` flag (``HAS_*``) its callers degrade by. An
# entry that needs importing a heavy or optional part of torch (inductor, distributed) is a
# function, so ``import convbn`` stays cheap and never fails on a torch that lacks it.
#
# What a release that changed a private name looks like here: 2.15 keeps torch.fx's
# "a symbolic trace is running" flag per thread (``fx_tracing_flag`` / ``set_fx_tracing_flag``),
# and its ``autograd.Function.apply`` is no longer a ``classmethod`` (``function_apply_impl``).
"""
from __future__ import annotations

import threading

from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch
import torch.fx._symbolic_trace as _fx_trace  # torch.fx's tracer internals (every release)
import torch.nn.modules.module as _nn_module
from torch.fx import graph_module as _fx_graph_module
from torch.utils import _pytree as pytree  # 1.x on: tree_leaves / tree_map / tree_flatten / tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode  # 1.13 on

__all__ = [
    "MINIMUM_TORCH", "pytree", "TorchDispatchMode", "current_dispatch_mode", "dispatch_mode_stack",
    "dispatch_modes_disabled",
    "fx_assert", "fx_assert_is_none", "FxPatcher", "fx_trace_globals", "orig_module_call", "orig_module_getattr",
    "fx_tracing_flag", "set_fx_tracing_flag", "forward_from_src", "FakeTensorMode",
    "set_grad_enabled_now", "InferenceModeContext", "current_autograd_node", "storage_use_count",
    "will_engine_execute_node", "graph_task_keeps_graph", "engine_grad", "SingleLevelFunction", "function_apply_impl",
    "function_apply_wrapper", "global_module_hooks", "functorch_config", "inductor_compile_fx", "inductor_config", "dynamo_config",
    "SAC_ADVISORY_LOGGER", "FAKE_TENSOR_LOGGER", "is_non_overlapping_and_dense_or_false", "dense_or_false_fallback", "make_channels_last_strides_for",
    "make_contiguous_strides_for", "suggest_memory_format", "mem_tracker_class", "mod_tracker_module",
    "HAS_MEM_TRACKER", "sparse_parts", "mem_tracker_total", "mod_tracker_of", "set_mod_tracker",
    "name_module", "hookless_mem_tracker", "lean_mem_tracker", "sparse_counting_mem_tracker", "frozen_safe_mem_tracker", "fsdp_state_of", "insert_module_state", "fsdp_new_init_disabled", "InstanceNormBase",
    "conv_backend",
]

#: The oldest torch convbn declares (pyproject ``torch>=2.8``): the oldest release on which its
#: compatibility subset passes (docs/torch-versions.md). 2.5 is the first with what convbn is built
#: on (the public selective-checkpoint API, ``torch.distributed._tools.mem_tracker``), and the
#: entries below keep their 2.5 - 2.7 fallbacks, but the subset fails there. For messages only.
MINIMUM_TORCH = "2.8"

# --- nn module bases ------------------------------------------------------------------------
#: ``torch.nn.modules.instancenorm._InstanceNorm``: every release; the base of
#: ``nn.InstanceNorm{1,2,3}d`` (and of the lazy ones), whose forward the norm table recognises.
from torch.nn.modules.instancenorm import _InstanceNorm as InstanceNormBase  # noqa: E402

# --- dispatch modes ------------------------------------------------------------------------
# torch.utils._python_dispatch._get_current_dispatch_mode / _get_current_dispatch_mode_stack: 2.0
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as dispatch_mode_stack  # noqa: E402
# torch.utils._python_dispatch._disable_current_modes: 2.0 on; every dispatch mode popped within
# the block (an operator run from inside a mode without any mode, the meter's included, seeing it)
from torch.utils._python_dispatch import _disable_current_modes as dispatch_modes_disabled  # noqa: E402

# --- torch.fx internals --------------------------------------------------------------------
#: ``torch._assert``: 1.8 on, the traceable assert fx graphs call.
fx_assert: Callable[..., Any] = torch._assert


def _never_called(*args: Any) -> None:  # a target no fx node has: where torch lacks the helper
    return None


#: ``torch.fx._symbolic_trace._assert_is_none`` (2.0 on): the assertion fx records for a
#: ``concrete_args`` entry of ``None``; without it, no node matches and nothing is specialised.
fx_assert_is_none: Callable[..., Any] = getattr(_fx_trace, "_assert_is_none", _never_called)
#: ``torch.fx._symbolic_trace._Patcher`` (1.x on): the patcher a symbolic trace patches with.
FxPatcher: type = _fx_trace._Patcher
#: torch.fx's ``nn.Module.__call__`` / ``__getattr__`` as they are outside a trace (1.x on).
orig_module_call: Callable[..., Any] = _fx_trace._orig_module_call
orig_module_getattr: Callable[..., Any] = _fx_trace._orig_module_getattr
#: ``torch.fx.graph_module._forward_from_src`` (1.x on): compiles a graph's Python code.
forward_from_src: Callable[..., Any] = _fx_graph_module._forward_from_src


def fx_trace_globals() -> Dict[str, Any]:
    """The globals of ``torch.fx._symbolic_trace``, where ``_new_patcher`` (2.1 on) is looked up
    by each trace (``thread_patch`` swaps it for the tracing thread only)."""
    return _fx_trace.__dict__


def fx_tracing_flag() -> Optional[bool]:
    """torch.fx's module-global "a symbolic trace is running" flag (``_is_fx_tracing_flag``,
    1.x to 2.14); ``None`` where torch keeps it per thread (2.15 on), so a trace in another
    thread cannot leave it set and there is nothing to save."""
    if "_is_fx_tracing_flag" in _fx_trace.__dict__:
        return bool(_fx_trace.__dict__["_is_fx_tracing_flag"])
    return None


def is_fx_tracing() -> bool:
    """Whether a ``torch.fx`` symbolic trace is running (in this thread where torch keeps the
    flag per thread): ``is_fx_symbolic_tracing`` where torch has it (2.13 does, 2.8 does not;
    ``is_fx_tracing`` there warns that it also answers for ``torch.export``), else the
    module-global flag."""
    probe = getattr(_fx_trace, "is_fx_symbolic_tracing", None)
    if callable(probe):
        return bool(probe())
    return bool(fx_tracing_flag())


def set_fx_tracing_flag(value: Optional[bool]) -> None:
    """Put back what :func:`fx_tracing_flag` returned (nothing to do for ``None``)."""
    if value is not None and "_is_fx_tracing_flag" in _fx_trace.__dict__:
        _fx_trace._is_fx_tracing_flag = value  # type: ignore[attr-defined]


def FakeTensorMode(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - torch's class, imported on use
    """``torch._subclasses.fake_tensor.FakeTensorMode(*args, **kwargs)`` (2.0 on), imported on first use."""
    from torch._subclasses.fake_tensor import FakeTensorMode as mode

    return mode(*args, **kwargs)


# --- autograd internals --------------------------------------------------------------------
#: ``torch._C._set_grad_enabled`` (1.x on): set grad mode without a context object.
set_grad_enabled_now: Callable[[bool], None] = torch._C._set_grad_enabled
#: ``torch._C._InferenceMode`` (1.9 on): the context ``torch.inference_mode`` enters.
InferenceModeContext: type = torch._C._InferenceMode


def current_autograd_node() -> Any:
    """``torch._C._current_autograd_node()`` (1.13 on): the node whose backward is running on
    this thread; ``None`` outside a backward (and where torch cannot tell)."""
    fn = getattr(torch._C, "_current_autograd_node", None)
    return None if fn is None else fn()


def storage_use_count(storage: Any) -> int:
    """``torch._C._storage_Use_Count`` (2.1 on): C++ references to an untyped storage.

    Raises:
        AttributeError: this torch has no such count (callers treat the storage as shared).
    """
    return int(torch._C._storage_Use_Count(storage._cdata))


def will_engine_execute_node(node: Any) -> bool:
    """``torch._C._will_engine_execute_node`` (1.13 on): whether the running backward runs ``node``.

    Raises:
        RuntimeError: no backward is running, or torch refuses the question (a leaf's node).
    """
    fn = getattr(torch._C, "_will_engine_execute_node", None)
    if fn is None:
        raise RuntimeError("this torch cannot tell which autograd nodes a backward runs")
    return bool(fn(node))


def graph_task_keeps_graph() -> bool:
    """``torch._C._autograd._get_current_graph_task_keep_graph()`` (2.0 on): whether the running
    backward retains its graph; ``True`` (the safe answer) where torch cannot tell."""
    fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    try:
        return True if fn is None else bool(fn())
    except RuntimeError:  # no graph task on this thread
        return True


#: ``torch.autograd.graph._engine_run_backward`` (2.4 on, found by ``getattr``): the engine call ``torch.autograd.grad``
#: makes once it has checked its arguments.
_engine_run_backward: Optional[Callable[..., Any]] = getattr(torch.autograd.graph, "_engine_run_backward", None)


def engine_grad(output: torch.Tensor, inputs: Sequence[torch.Tensor],
                grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    """``torch.autograd.grad(output, inputs, grad, allow_unused=True)`` without its argument
    checks (a few tens of microseconds of Python per call; Note: [one autograd.grad per layer] in
    autograd/norm_chain.py): for a caller whose ``grad`` has ``output``'s shape by construction.
    The same engine call with the same arguments, so the same gradients; ``torch.autograd.grad``
    itself where torch lacks the engine call or a tensor is a subclass (its ``__torch_function__``
    must see the call)."""
    if _engine_run_backward is None or any(type(t) is not torch.Tensor for t in (output, grad, *inputs)):
        return torch.autograd.grad(output, inputs, grad, allow_unused=True)
    return tuple(_engine_run_backward((output,), (grad,), False, False, tuple(inputs), True, accumulate_grad=False))


#: ``torch.autograd.function._SingleLevelFunction`` (2.0 on): the base whose
#: ``setup_context`` a Function without its own inherits; ``Function`` itself before.
SingleLevelFunction: type = getattr(torch.autograd.function, "_SingleLevelFunction", torch.autograd.Function)


def function_apply_impl(apply: Any) -> Callable[..., Any]:
    """The plain function behind ``torch.autograd.Function.apply`` as stored on the class,
    called as ``impl(cls, *args)``: the ``__func__`` of a ``classmethod`` (up to 2.14), the
    function itself where ``apply`` is stored as a plain function or descriptor (2.15 on)."""
    if isinstance(apply, classmethod):
        return apply.__func__
    inner = getattr(apply, "__func__", None)
    if inner is not None:  # a bound method
        return inner
    if callable(apply):
        return apply
    raise TypeError(f"torch.autograd.Function.apply is a {type(apply).__name__}; "
                    "expected a classmethod or a function taking the class first")


def function_apply_wrapper(impl: Callable[..., Any]) -> Any:
    """What to store as ``Function.apply`` so that ``cls.apply(*args)`` calls ``impl(cls, *args)``:
    a ``classmethod`` on every release (what 2.15's own ``apply`` descriptor does too)."""
    return classmethod(impl)


def global_module_hooks() -> Tuple[Any, ...]:
    """The global module hook registries of ``torch.nn.modules.module`` (forward pre, forward,
    backward: 1.x on; backward pre: 2.0 on), each a dict; missing ones as empty dicts."""
    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return tuple(getattr(_nn_module, n, {}) for n in names)


# --- compilers (imported on use: inductor is heavy) ----------------------------------------
def functorch_config() -> Any:
    """``torch._functorch.config`` (2.0 on): AOTAutograd's partitioner settings."""
    import torch._functorch.config as config

    return config


def inductor_config() -> Any:
    """``torch._inductor.config`` (2.0 on): inductor's settings (``layout_optimization`` ...)."""
    import torch._inductor.config as config

    return config


def dynamo_config() -> Any:
    """``torch._dynamo.config`` (2.0 on): Dynamo's settings (``recompile_limit``, before 2.6
    ``cache_size_limit``)."""
    import torch._dynamo.config as config

    return config


def inductor_compile_fx() -> Callable[..., Any]:
    """``torch._inductor.compile_fx.compile_fx`` (2.0 on): inductor as a backend function."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


#: The logger torch's selective-checkpoint advisory is written to (2.4 on).
SAC_ADVISORY_LOGGER = "torch._higher_order_ops.wrap"

#: The logger ``FakeTensorMode`` writes an operator's failed meta run to, with its traceback, before
#: it raises the error again (2.1 on; a logger of that name exists on every release, so on one
#: that does not write there, nothing is filtered).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# --- strides (torch._prims_common, 2.0 on) -------------------------------------------------
from torch._prims_common import (  # noqa: E402
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,
)

def dense_or_false_fallback(a: torch.Tensor) -> bool:
    """Whether some order of ``a``'s dimensions makes it contiguous (non-overlapping and dense),
    from its sizes and strides as torch's own check reads them; ``False`` where a symbolic size
    or stride cannot be decided."""
    try:
        if a.is_sparse:
            return False
        if a.numel() == 0:
            return True
        if a.dim() == 1:
            return int(a.stride(0)) == 1 or int(a.shape[0]) < 2
        expected = 1
        for size, stride in sorted(zip(a.shape, a.stride()), key=lambda p: int(p[1])):  # smallest stride first
            if int(size) == 1:
                continue
            if int(stride) != expected:
                return False
            expected *= int(size)
        return True
    except Exception:  # noqa: BLE001 - a data-dependent symbolic size: not known to be dense
        return False


try:  # torch._prims_common.is_non_overlapping_and_dense_or_false: 2.9 on
    from torch._prims_common import is_non_overlapping_and_dense_or_false
except ImportError:
    is_non_overlapping_and_dense_or_false = dense_or_false_fallback  # type: ignore[assignment]


# --- memory meters (torch.distributed._tools, 2.5 on) --------------------------------------
def _has_submodule(package: Any, *parts: str) -> bool:
    """Whether ``package`` ships the submodule ``parts`` (a file or a package), looked up on its
    ``__path__`` without importing anything: ``importlib.util.find_spec`` of a dotted name imports
    every parent package, and ``torch.distributed._tools``'s ``__init__`` pulls in dynamo, inductor
    and DTensor (about 1.3 s of CPU on every ``import convbn``)."""
    import os

    for root in getattr(package, "__path__", ()):
        where = os.path.join(root, *parts)
        if os.path.isfile(where + ".py") or os.path.isfile(os.path.join(where, "__init__.py")):
            return True
    return False


#: Whether this torch has ``torch.distributed._tools.mem_tracker`` (2.5 on, with distributed).
HAS_MEM_TRACKER: bool = _has_submodule(torch.distributed, "_tools", "mem_tracker")


def sparse_parts(t: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
    """The dense tensors a sparse tensor's memory is made of, ``()`` for a strided one, ``None``
    for a layout not known here. COO: ``Tensor._indices()`` / ``_values()`` (every release: read
    without coalescing, which would allocate); compressed layouts: their public index accessors."""
    if t.layout == torch.strided:
        return ()
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return None


def mem_tracker_class() -> type:
    """``torch.distributed._tools.mem_tracker.MemTracker`` (2.5 on).

    Raises:
        ImportError: one line naming what this torch lacks and what works without it.
    """
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as err:
        raise ImportError(f"convbn's exact tensor peak needs torch.distributed._tools.mem_tracker (torch >= "
                          f"{MINIMUM_TORCH} built with distributed); this torch {torch.__version__} has none: "
                          "use convbn.memory.peak_memory() instead") from err
    return MemTracker


# --- MemTracker internals (torch.distributed._tools.mem_tracker, 2.5 on) ------------------------
# convbn's exact CPU meter (memory/peaks.py's tensor_peak, memory/timelines.py's timeline) is torch's
# MemTracker with some of its private members overridden or read: all of them are here, so that a
# release that renames one breaks this section alone (tests/test_step_peak.py checks the totals).
def mem_tracker_total(tracker: Any) -> int:
    """Bytes a ``MemTracker`` counts live now, summed over devices (its ``_curr_mem_snap``)."""
    return sum(int(dev.get("Total", 0)) for dev in tracker._curr_mem_snap.values())


def mod_tracker_of(tracker: Any) -> Any:
    """The ``ModTracker`` a ``MemTracker`` names modules with (its ``_mod_tracker``)."""
    return tracker._mod_tracker


def set_mod_tracker(tracker: Any, mod_tracker: Any) -> None:
    """Give a ``MemTracker`` another ``ModTracker`` (before it is entered)."""
    tracker._mod_tracker = mod_tracker


def name_module(mod_tracker: Any, module: Any, name: str) -> None:
    """Tell a ``ModTracker`` a module's qualified name (its ``_known_modules``): it names modules
    by walking ``named_children``, which does not list modules a rewrite holds unregistered."""
    mod_tracker._known_modules[module] = name


def mod_tracker_module() -> Any:
    """The module ``torch.distributed._tools.mod_tracker`` (2.5 on); see :func:`mem_tracker_class`."""
    mem_tracker_class()  # the same one-line error where it is missing
    from torch.distributed._tools import mod_tracker

    return mod_tracker


# --- FSDP2 internals (torch.distributed.fsdp._fully_shard: 2.6 on) -------------------------
def fsdp_state_of(module: Any) -> Any:
    """FSDP2's state of ``module`` (``_get_module_fsdp_state``: 2.6 on; ``None`` for a module
    ``fully_shard`` was not applied to, and on a torch without FSDP2 or distributed)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        try:  # 2.4 - 2.5: FSDP2 under torch.distributed._composable
            from torch.distributed._composable.fsdp._fsdp_state import _get_module_fsdp_state
        except ImportError:
            return None
    return _get_module_fsdp_state(module)


def insert_module_state(module: Any, state: Any) -> None:
    """``torch.distributed._composable_state._insert_module_state`` (2.0 on): enter ``module``
    into the composable APIs' weak module -> state map."""
    from torch.distributed._composable_state import _insert_module_state

    _insert_module_state(module, state)


def fsdp_new_init_disabled() -> Optional[ContextManager[None]]:
    """FSDP2's ``disable_fsdp_module_new_init()`` (2.9 on): within it, making an object of an
    ``FSDP<Module>`` class does not call the original class's ``__init__``; ``None`` where
    this torch has no such switch (callers then make the object without ``__new__``)."""
    try:
        from torch.distributed.fsdp._fully_shard._fully_shard import disable_fsdp_module_new_init
    except ImportError:
        return None
    return disable_fsdp_module_new_init()


def hookless_mem_tracker(base: Any) -> Any:
    """``MemTracker`` that installs no gradient hooks on parameters.

    # Note: [a meter that does not change the step]
    # ``MemTracker`` registers a tensor hook and a post-accumulate hook on every parameter
    # of a module it sees run, only to label gradient storages as gradients in its
    # per-category statistics; its totals come from its dispatch mode, which sees every
    # allocation either way (tests/test_step_peak.py checks the totals equal to the byte). A tensor hook
    # is an observer of the gradient, so with it convbn's chains must return their
    # weight gradients to autograd instead of accumulating them as eager's engine does
    # (Note: [weight gradients as eager releases them]): the meter would measure another
    # step than the user runs. convbn only reads totals, so it measures without the hooks.
    """

    _TOTAL = "Total"  # torch's key of a device's total in a snapshot (mem_tracker._TOTAL_KEY)

    class HooklessMemTracker(base):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Note: [a meter that reads totals only]
            # torch's tracker updates, after every operator, the peak of every module it has
            # seen run (a walk over all of them: operators x modules, quadratic in the model's
            # size; on a 300-BatchNorm HRNet-style net most of a recorded step's time). convbn
            # reads the totals only, so only the totals' peak is kept, exactly as torch keeps it.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)

        def get_tracker_snapshot(self, type: str = "current") -> Any:  # noqa: A002 - torch's name
            # Note: [a snapshot copied as what it is]
            # torch copies a snapshot with ``copy.deepcopy``, and its module hooks take one before and
            # after every module's forward and backward: most of the meter's own cost on a step of
            # small operators (ResNet-50 at batch 2). A snapshot is a dict of devices to dicts of
            # names to ints; copied level by level it is the same value.
            snap = {"current": self._curr_mem_snap, "peak": self._peak_mem_snap}.get(type)
            if snap is None or not all(isinstance(v, dict) for v in snap.values()):
                return super().get_tracker_snapshot(type)
            return {dev: dict(v) for dev, v in snap.items()}

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            # a module called again with no tracked parent (one activation module shared by
            # every layer, run by a fused chain's eager part) looks like a next iteration to
            # MemTracker, which raises; its per-module statistics are not read here: restart them
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.memory_tracking.pop(module, None)
                super()._pre_fw_hook(module, inputs)

    return HooklessMemTracker


def lean_mem_tracker(base: Any) -> Any:
    """``base`` (a ``MemTracker``) whose module hooks keep no per-module statistics: the first
    time a module runs its own tensors are counted, nothing else (Note: [a meter that keeps no
    module statistics]). ``base``'s hooks as they are stay the reference it is tested against."""

    # Note: [a meter that keeps no module statistics]
    # torch's module hooks (run by its ModTracker before and after every module's forward
    # and backward) record per-module statistics: copies of the snapshot, the bytes of each
    # module's inputs and outputs, the peak inside it. convbn reads totals only (Note: [a
    # meter that reads totals only]), and of those hooks only one thing moves a total: the
    # first time a module runs, its parameters, their gradients and its buffers are counted
    # where nothing counted them yet (a module the model holds outside its registered
    # children). That is all these hooks do here (without gradient hooks: Note: [a meter that
    # does not change the step]); the rest was about a fifth of the meter's own cost on a
    # ResNet-50 step at batch 1 (0.175 -> 0.143 CPU s above the unmetered step's 0.40). Totals
    # are unchanged (tests/test_lean_meter.py compares them with torch's hooks, point by
    # point). A module called again with no tracked parent (one activation
    # module shared by every layer), which torch's hook takes for a next iteration and
    # raises on, is simply seen again.
    class LeanMemTracker(base):  # type: ignore[misc, valid-type]
        def __enter__(self) -> Any:
            _outputs_walked_plainly(True)  # Note: [an operator's outputs walked without pytree]
            try:
                return super().__enter__()
            except BaseException:
                _outputs_walked_plainly(False)
                raise

        def __exit__(self, *args: Any) -> None:
            try:
                super().__exit__(*args)
            finally:
                _outputs_walked_plainly(False)

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module not in self.memory_tracking:
                self._track_module_params_and_buffers(module, install_grad_hooks=False)
                self.memory_tracking[module] = True  # seen: its own tensors are counted

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            pass

    return LeanMemTracker


# Note: [an operator's outputs walked without pytree]
# ``MemTracker`` counts an operator's outputs with ``tree_map_only(torch.Tensor, track, outputs)``:
# a pytree flatten and unflatten per operator, about 20 us, most of the meter's own cost per
# operator (a recorded ResNet-50 step runs over a thousand). What operators return is a tensor or
# a tuple or list of tensors, ``None`` and numbers; for those, while a lean tracker is entered,
# the ``tree_map_only`` MemTracker's module calls visits the same tensors in the same order
# without pytree (``tree_map_only``'s own result is not read there); anything else (a subclass,
# a nested or registered container) goes to pytree as before. The module global is put back
# when the last lean tracker leaves (a count, entered from any thread); the walk is the same
# either way, so another tracker meanwhile sees the same totals.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_VALUES = (int, float, bool, type(None))
_WALKS = [0, None]  # lean trackers entered, torch's tree_map_only while they are
_WALKS_LOCK = threading.Lock()


def _plain_tree_map_only(types: Any, fn: Callable[[Any], Any], tree: Any, is_leaf: Any = None) -> Any:
    """``tree_map_only`` for MemTracker's calls (Note: [an operator's outputs walked without pytree])."""
    if types is torch.Tensor and is_leaf is None:
        if type(tree) in _PLAIN_TENSORS:
            fn(tree)
            return tree
        if type(tree) in (tuple, list) and all(type(v) in _PLAIN_TENSORS or type(v) in _PLAIN_VALUES for v in tree):
            for v in tree:
                if type(v) in _PLAIN_TENSORS:
                    fn(v)
            return tree
    return _WALKS[1](types, fn, tree, is_leaf=is_leaf)


def _outputs_walked_plainly(enter: bool) -> None:
    """Swap MemTracker's ``tree_map_only`` for :func:`_plain_tree_map_only` while a lean tracker is
    entered (``enter``), and back when the last one leaves."""
    from torch.distributed._tools import mem_tracker

    if not callable(getattr(mem_tracker, "tree_map_only", None)):
        return  # a torch whose MemTracker walks otherwise: its own walk, as it is
    with _WALKS_LOCK:
        if enter:
            if _WALKS[0] == 0:
                _WALKS[1] = mem_tracker.tree_map_only
                mem_tracker.tree_map_only = _plain_tree_map_only
            _WALKS[0] += 1
        else:
            _WALKS[0] -= 1
            if _WALKS[0] == 0:
                mem_tracker.tree_map_only = _WALKS[1]


def sparse_counting_mem_tracker(base: Any) -> Any:
    """``MemTracker`` that counts a sparse tensor as the dense tensors it is made of (torch's
    reads ``untyped_storage()``, which a sparse tensor has not: it raised mid-step); a layout
    whose parts are not known here is a ``NotImplementedError`` naming it (the planner then
    plans lazily: Note: [a step the meters cannot measure] in passes/plan/auto_plan.py)."""

    class SparseCountingMemTracker(base):  # type: ignore[misc, valid-type]
        def _track(self, reftype: Any, t: Any) -> None:
            parts = sparse_parts(t)
            if parts is None:
                raise NotImplementedError(f"tensor_peak cannot count a tensor of layout {t.layout} (shape "
                                          f"{tuple(t.shape)}): only strided and sparse COO / CSR / CSC / BSR / "
                                          "BSC tensors are measured")
            for part in parts or (t,):
                super()._track(reftype, part)

        def _update_and_maybe_create_winfos(self, t: Any, reftype: Any, update_existing: bool = False) -> Any:
            parts = sparse_parts(t)
            if not parts:  # strided (torch's own path), or an unknown layout (torch's error)
                return super()._update_and_maybe_create_winfos(t, reftype, update_existing)
            return set().union(*(super(SparseCountingMemTracker, self)._update_and_maybe_create_winfos(
                part, reftype, update_existing) for part in parts))

        def _track_inputs_or_outputs(self, args: Any) -> int:
            return super()._track_inputs_or_outputs(pytree.tree_map_only(torch.Tensor, _dense_parts, args))

    return SparseCountingMemTracker


def _dense_parts(t: torch.Tensor) -> Any:
    """``t``, or the tuple of dense tensors a sparse ``t`` is made of."""
    parts = sparse_parts(t)
    return t if not parts else parts


class _NoHandle:
    def remove(self) -> None:
        pass


def frozen_safe_mem_tracker(tracker_cls: type) -> type:
    """``MemTracker`` that skips the gradient hooks of frozen parameters: it registers one
    on every parameter of a module it enters, which raises for ``requires_grad=False``."""

    class FrozenSafeMemTracker(tracker_cls):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenSafeMemTracker


# --- convolution backends ---------------------------------------------------------------------
def conv_backend(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                 groups: int) -> Optional[str]:
    """The kernel family torch picks for this convolution (``"Mkldnn"``, ``"Slow2d"``, ...), from
    ``torch._C._select_conv_backend`` (2.0 on; it reads shapes, dtype, device and the thread
    count, not the data: stand-ins expanded from one element do); ``None`` where torch lacks it
    or refuses the arguments (the caller then assumes the costliest family)."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        return None
    try:
        backend = select(x, weight, None, list(stride), list(padding), list(dilation), bool(transposed),
                         list(output_padding), int(groups), None)
    except (RuntimeError, TypeError):
        return None
    return str(backend).rpartition(".")[2]
