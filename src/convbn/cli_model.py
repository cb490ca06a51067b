"""The model and input of ``convbn explain`` / ``convbn fold``: spec, checkpoint, shape, dtype.

A ``SPEC`` is a benchmark model spec or ``module:callable`` (:func:`convbn.bench.models.build_model`);
``--checkpoint PATH`` loads trained weights into it (:func:`load_checkpoint`); the input is
``--input-shape`` or the spec's own shape with ``--batch-size``, checked by one forward
before any work so that a wrong shape is one line, not a traceback from deep inside a pass.

Example:
    $ convbn explain mynet:build --checkpoint runs/last.ckpt --input-shape 8x3x256x256
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .cli import device_arg, existing_file, input_shape

__all__ = ["CHECKPOINT_KEYS", "add_model_arguments", "load_model", "load_checkpoint", "resolve_shape", "model_input", "channels_last_format"]

#: Keys under which training loops store a model's state_dict in a checkpoint, tried in this order.
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "state_dict_ema", "model_ema", "ema", "module", "net")

#: Prefixes that wrappers add to every key (DDP, torch.compile, a LightningModule's ``self.model``).
_PREFIXES = ("module.", "_orig_mod.", "model.", "net.")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``SPEC``, ``--checkpoint``, ``--input-shape``, ``--batch-size``, ``--device``."""
    parser.add_argument("spec", metavar="SPEC", help="model spec (mnist, monai:resnet18, ...) or module:callable")
    parser.add_argument("--checkpoint", type=existing_file, default=None, metavar="PATH",
                        help="load these weights into the model: a state_dict, or a checkpoint dict holding one under "
                             f"one of {', '.join(CHECKPOINT_KEYS)}")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="NxCxHxW",
                        help="full input shape with batch (default: the spec's own shape with --batch-size)")
    parser.add_argument("--batch-size", type=int, default=2, help="batch for the spec's default shape")
    parser.add_argument("--device", type=device_arg, default="cpu", help="torch device")


def _tensors_only(d: Mapping[Any, Any]) -> bool:
    return bool(d) and all(isinstance(k, str) for k in d) and all(isinstance(v, Tensor) for v in d.values())


def _candidates(obj: Any) -> List[Tuple[str, Dict[str, Tensor]]]:
    """The state_dicts a checkpoint may hold: itself, or the dict under each of :data:`CHECKPOINT_KEYS`."""
    found: List[Tuple[str, Dict[str, Tensor]]] = []
    if isinstance(obj, Mapping):
        if _tensors_only(obj):
            found.append(("the file", dict(obj)))
        for key in CHECKPOINT_KEYS:
            value = obj.get(key)
            if isinstance(value, nn.Module):
                value = value.state_dict()
            if isinstance(value, Mapping) and _tensors_only(value):
                found.append((f"key {key!r}", dict(value)))
    elif isinstance(obj, nn.Module):
        found.append(("the saved module", obj.state_dict()))
    return found


def _strip(state: Dict[str, Tensor], wanted: set) -> Dict[str, Tensor]:
    """``state`` with a wrapper's prefix taken off every key where that makes the keys ``wanted``."""
    for _ in range(3):  # a prefix may be nested: module.model.
        if set(state) == wanted:
            return state
        for prefix in _PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                break
            # a LightningModule saves its own extra tensors beside self.model's: keep the model's only
            inner = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if inner and set(inner) == wanted:
                return inner
        else:
            return state
    return state


def load_checkpoint(model: nn.Module, path: str) -> str:
    """Load the weights in ``path`` into ``model`` (strict: every key must match).

    ``path`` holds a state_dict, or a dict with one under a key of :data:`CHECKPOINT_KEYS`
    (Lightning, MONAI and timm checkpoints, plain ``{"model": ...}`` dicts); wrapper prefixes
    (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, ``model.`` of a LightningModule)
    are taken off when that makes the keys match. It is read with ``weights_only=True``.

    Args:
        model: the model to load into (as the spec builds it, before any convert or fold).
        path: the checkpoint file.

    Returns:
        Where the state_dict was found (``"the file"``, ``"key 'state_dict'"``, ...).

    Raises:
        OSError: the file cannot be read.
        ValueError: no state_dict in it matches the model (the message counts and names the
            missing and unexpected keys).
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # a missing or unreadable file: the command reports it as one line
    except Exception as exc:  # noqa: BLE001 - unpickling errors of every kind
        raise ValueError(f"--checkpoint {path!r} cannot be read as weights only ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})") from exc
    candidates = _candidates(obj)
    if not candidates:
        keys = list(obj)[:8] if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"--checkpoint {path!r} holds no state_dict (a dict of tensors), neither itself nor under "
                         f"one of {', '.join(CHECKPOINT_KEYS)}; it has {keys}")
    wanted = set(model.state_dict())
    stripped = [(where, _strip(state, wanted)) for where, state in candidates]
    for where, state in stripped:
        if set(state) == wanted:
            model.load_state_dict(state)
            return where
    where, state = max(stripped, key=lambda c: len(set(c[1]) & wanted))
    missing = sorted(wanted - set(state))
    unexpected = sorted(set(state) - wanted)
    hint = ""
    if any(k.endswith("running_mean") for k in missing) and not any(k.endswith("running_mean") for k in state):
        hint = ("; it has no BatchNorm statistics: it looks like a folded model's state_dict, which loads into "
                "convbn.fold(model), not into the model itself")
    raise ValueError(f"--checkpoint {path!r} ({where}) does not match the model: {len(missing)} key(s) missing "
                     f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}){hint}")


def load_model(spec: str, checkpoint: Optional[str] = None) -> Tuple[nn.Module, Tuple[int, ...]]:
    """The model named by ``spec`` (weights from ``checkpoint`` if given) and its input shape without batch.

    Raises:
        ValueError: a bad spec or a checkpoint that does not match.
        ImportError: the spec's package or module does not import (the message says why).
    """
    from .bench.models import build_model

    model, shape = build_model(spec)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model, tuple(shape)


def channels_last_format(dim: int) -> torch.memory_format:
    """``channels_last`` for 4-D tensors, ``channels_last_3d`` for 5-D; a ValueError otherwise."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if dim not in formats:
        raise ValueError(f"--channels-last needs a 4-D (NCHW) or 5-D (NCDHW) input, but the input has {dim} dimensions")
    return formats[dim]


def resolve_shape(spec: str, given: Optional[Tuple[int, ...]], default: Optional[Tuple[int, ...]],
                  batch: int) -> Tuple[int, ...]:
    """``--input-shape`` if given, else ``(batch, *default)``; an error when neither is known."""
    if given is not None:
        return tuple(given)
    if default is None:
        raise ValueError(f"{spec!r} has no known input shape; pass --input-shape, e.g. 8x3x224x224")
    return (batch,) + tuple(default)


def model_input(args: argparse.Namespace, model: nn.Module, default: Optional[Tuple[int, ...]],
                channels_last: bool = False) -> Tensor:
    """The random input of ``args`` (shape, device; channels-last if asked), checked by one forward of ``model``.

    Raises:
        ValueError: the model does not accept it (one line naming the shape and the model's error).
    """
    from .bench.models import check_input

    shape = resolve_shape(args.spec, args.input_shape, default, args.batch_size)
    x = torch.randn(*shape, device=args.device)
    if channels_last:
        x = x.contiguous(memory_format=channels_last_format(x.dim()))
    hint = "pass --input-shape with the shape the model takes" + (
        "" if args.input_shape is not None else f" (the default {'x'.join(map(str, shape))} was a guess)")
    check_input(model, x, args.spec, hint)
    return x
