"""``gradcheck`` / ``gradgradcheck`` for whole modules, parameters included.

:func:`torch.autograd.gradcheck` checks a *function* of tensors. A module's parameters
are hidden inside it, so :func:`gradcheck_module` turns the module into a pure function
with :func:`torch.func.functional_call`: inputs **and** parameters become explicit
arguments, and every one of them is checked against finite differences.

Note: [repeatable calls]
Finite differences call the function many times and require the same answer for the
same arguments. Two things in ordinary modules break that:

* BatchNorm in training mode updates ``running_mean`` / ``running_var`` /
  ``num_batches_tracked`` in place on every call. Each call here gets freshly cloned
  buffers, so those updates land on throw-away copies (and the output, which uses the
  batch statistics, is unaffected by them anyway).
* Random ops (dropout) draw a new mask per call. Each call runs inside
  :func:`torch.random.fork_rng` with the same seed, so every call sees the same mask,
  and the caller's global RNG state is left as it was.

The user's module is never modified: a deep copy is converted to float64 and checked.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["GradcheckReport", "gradcheck_module"]

_SEED = 20_240_601
_MAX_ERROR_LINES = 8


@dataclass
class GradcheckReport:
    """Outcome of :func:`gradcheck_module`.

    Attributes:
        first_order: ``True`` when ``gradcheck`` passed.
        second_order: ``True``/``False`` for ``gradgradcheck``; ``None`` when not run.
        errors: ``{"first_order" | "second_order": message}`` for each failed check.
        module_name: class name of the checked module.
        variables: names of the tensors treated as differentiable, e.g.
            ``("input[0]", "0.weight")``.

    Example:
        >>> report = gradcheck_module(torch.nn.Linear(2, 2), torch.randn(3, 2))
        >>> report.passed
        True
    """

    first_order: bool
    second_order: Optional[bool]
    errors: Dict[str, str] = field(default_factory=dict)
    module_name: str = ""
    variables: Tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """``True`` when every check that ran passed.

        Returns:
            ``first_order and second_order is not False``.

        Example:
            >>> GradcheckReport(first_order=True, second_order=None).passed
            True
        """
        return self.first_order and self.second_order is not False

    def __str__(self) -> str:
        def verdict(value: Optional[bool]) -> str:
            return "not run" if value is None else ("passed" if value else "FAILED")

        names = ", ".join(self.variables)
        lines = [
            f"gradcheck report for {self.module_name or 'module'} "
            f"(float64; {len(self.variables)} differentiable tensors: {names})",
            f"  first order  (gradcheck):     {verdict(self.first_order)}",
            f"  second order (gradgradcheck): {verdict(self.second_order)}",
        ]
        for key, message in self.errors.items():
            body = message.strip().splitlines()
            shown = body[:_MAX_ERROR_LINES]
            if len(body) > len(shown):
                shown.append(f"... ({len(body) - len(shown)} more lines)")
            lines.append(f"  {key} error:")
            lines.extend(f"    {line}" for line in shown)
        return "\n".join(lines)


def _flatten_outputs(output: Any) -> List[Tensor]:
    """Floating-point tensors of a (nested tuple/list/dict) module output, in order."""
    if isinstance(output, Tensor):
        return [output] if (output.is_floating_point() or output.is_complex()) else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _flatten_outputs(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _flatten_outputs(item)]
    return []


def _as_double(t: Tensor) -> Tensor:
    """Detached copy of ``t``, float64 if it is floating point (other dtypes kept)."""
    t = t.detach()
    if t.is_floating_point():
        return t.to(torch.float64, copy=True)
    return t.clone()


def _build_function(
    module: nn.Module,
    inputs: Sequence[Tensor],
    diff_input_positions: Sequence[int],
    param_names: Sequence[str],
    fixed_state: Dict[str, Tensor],
    buffers: Dict[str, Tensor],
    cuda_devices: Sequence[int],
) -> Callable[..., Tuple[Tensor, ...]]:
    """Pure function ``(diff inputs..., diff params...) -> floating outputs``."""
    n_diff_inputs = len(diff_input_positions)

    def run(*tensors: Tensor) -> Tuple[Tensor, ...]:
        call_inputs = list(inputs)
        for position, tensor in zip(diff_input_positions, tensors[:n_diff_inputs]):
            call_inputs[position] = tensor
        state: Dict[str, Tensor] = dict(fixed_state)
        state.update(zip(param_names, tensors[n_diff_inputs:]))
        # See Note: [repeatable calls] -- fresh buffers and the same RNG stream per call.
        state.update({name: buf.clone() for name, buf in buffers.items()})
        with torch.random.fork_rng(devices=list(cuda_devices)):
            torch.manual_seed(_SEED)
            output = functional_call(module, state, tuple(call_inputs))
        return tuple(_flatten_outputs(output))

    return run


def _check_arguments(module: Any, inputs: Sequence[Any]) -> None:
    """Raise unless ``module`` is an ``nn.Module`` and every input a tensor."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"gradcheck_module expects an nn.Module as first argument, but got "
            f"{type(module).__name__}; to check a plain function use torch.autograd.gradcheck"
        )
    for index, value in enumerate(inputs):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"gradcheck_module expects tensor inputs, but input[{index}] is "
                f"{type(value).__name__}; bind non-tensor arguments into the module "
                "(e.g. with a small wrapper module) first"
            )


@dataclass
class _Variables:
    """A float64 module's inputs and state, split into what is differentiated and what is fixed."""

    call_inputs: List[Tensor]  # float64 copies of the inputs (floating ones require grad)
    diff_input_positions: List[int]
    param_names: List[str]  # the parameters that require grad
    diff_params: List[Tensor]  # their float64 copies, requiring grad
    fixed_state: Dict[str, Tensor]  # frozen parameters
    buffers: Dict[str, Tensor]

    @classmethod
    def of(cls, checked: nn.Module, inputs: Sequence[Tensor]) -> "_Variables":
        call_inputs = [_as_double(t) for t in inputs]
        diff_input_positions = [i for i, t in enumerate(call_inputs) if t.is_floating_point()]
        for position in diff_input_positions:
            call_inputs[position].requires_grad_(True)
        param_names: List[str] = []
        diff_params: List[Tensor] = []
        fixed_state: Dict[str, Tensor] = {}
        for name, param in checked.named_parameters():
            if param.requires_grad:
                param_names.append(name)
                diff_params.append(param.detach().clone().requires_grad_(True))
            else:
                fixed_state[name] = param.detach()
        buffers = {name: buf.detach() for name, buf in checked.named_buffers()}
        return cls(call_inputs, diff_input_positions, param_names, diff_params, fixed_state, buffers)

    @property
    def diff_vars(self) -> Tuple[Tensor, ...]:
        """The differentiable inputs, then the differentiable parameters."""
        return tuple(self.call_inputs[i] for i in self.diff_input_positions) + tuple(self.diff_params)

    @property
    def names(self) -> Tuple[str, ...]:
        """:attr:`diff_vars`' names: ``input[i]`` or the parameter's name."""
        return tuple(f"input[{i}]" for i in self.diff_input_positions) + tuple(self.param_names)


def gradcheck_module(  # over 60 lines for its public docstring (the maths, Args, Example); the body is ~55
    module: nn.Module,
    *inputs: Tensor,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    check_grad_grad: bool = True,
    nondet_tol: float = 0.0,
    raise_exception: bool = False,
) -> GradcheckReport:
    """Run ``gradcheck`` (and ``gradgradcheck``) on a module, parameters included.

    Differentiable variables: every floating-point input and every parameter with
    ``requires_grad=True``; all are checked in float64. Integer inputs and frozen
    parameters are passed through as constants. Buffers are cloned per call and the
    RNG is reseeded per call (see the module note), so BatchNorm in training mode and
    dropout give repeatable results. The finite-difference test compares

    .. math::
        J_{\\text{analytic}} \\approx
        \\frac{f(\\theta + \\epsilon e_k) - f(\\theta - \\epsilon e_k)}{2 \\epsilon}

    column by column, and ``gradgradcheck`` does the same for the backward pass.

    Args:
        module: the module to check; it is deep-copied, never modified.
        *inputs: positional tensor inputs of ``module.forward``.
        eps: finite-difference step.
        atol: absolute tolerance.
        rtol: relative tolerance.
        check_grad_grad: also run ``gradgradcheck``.
        nondet_tol: tolerance for non-determinism between two backward runs.
        raise_exception: raise the first failure instead of recording it in the report.

    Returns:
        A :class:`GradcheckReport`.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3))
        >>> print(gradcheck_module(net, torch.randn(2, 2, 4, 4)).passed)
        True
    """
    _check_arguments(module, inputs)
    checked = copy.deepcopy(module).to(torch.float64)
    v = _Variables.of(checked, inputs)
    diff_vars = v.diff_vars
    if not diff_vars:
        raise ValueError(
            "gradcheck_module found nothing to differentiate: no floating-point input and no "
            "parameter with requires_grad=True"
        )

    cuda_devices = sorted(
        {t.device.index or 0 for t in list(diff_vars) + list(v.buffers.values()) if t.is_cuda}
    )
    function = _build_function(checked, v.call_inputs, v.diff_input_positions, v.param_names, v.fixed_state,
                               v.buffers, cuda_devices)
    # A plain call first: a module that cannot even run should raise here, with its own
    # error, rather than be reported as a gradient failure.
    if not function(*diff_vars):
        raise ValueError(
            f"{type(module).__name__} returned no floating-point tensor, so there is no "
            "gradient to check"
        )

    report = GradcheckReport(
        first_order=False,
        second_order=None,
        module_name=type(module).__name__,
        variables=v.names,
    )

    def attempt(name: str, check: Callable[..., bool]) -> bool:
        try:
            return bool(check(function, diff_vars, eps=eps, atol=atol, rtol=rtol,
                              nondet_tol=nondet_tol, raise_exception=True))
        except Exception as error:  # noqa: BLE001 - reported to the user, re-raised on request
            if raise_exception:
                raise
            report.errors[name] = f"{type(error).__name__}: {error}"
            return False

    report.first_order = attempt("first_order", torch.autograd.gradcheck)
    if check_grad_grad:
        report.second_order = attempt("second_order", torch.autograd.gradgradcheck)
    return report
