"""convbn: fused Convolution + BatchNorm (+ activation) for PyTorch.

Training: :func:`convert` turns a CNN into one whose Conv -> BN (-> act) layers keep far
fewer activations for backward (same outputs, gradients, running stats, parameters and
``state_dict``). Inference: :func:`fold` folds BatchNorm into neighbouring layers.
"""
import warnings as _warnings

with _warnings.catch_warnings():
    # torch.export (which convbn's modules import) warns "Failed to initialize NumPy" where numpy
    # is not installed; convbn does not need numpy, so importing convbn stays quiet there
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch.export as _torch_export  # noqa: F401

from .autograd.dispatch import conv_bn_act
from .largest_batch import BatchFit, max_batch
from .functional.activations import ACTIVATIONS, Activation
from .autograd.chain_compiled import compile_chains
from .autograd.chain_kernels import fused_kernels
from .functional.deprecation import module_aliases as _module_aliases
from .functional.strategies import ConvertStrategy, Strategy
from .gradcheck import GradcheckReport, gradcheck_module
from .memory import PeakMemory, SavedBytes, Timeline, peak_memory, saved_bytes, tensor_peak, timeline, track_saved
from .nn.chain import FusedChain
from .nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d
from .passes.convert.api import convert, explain
from .passes.convert.saved_plan import ConvertPlan
from .passes.fold.api import FoldReport, fold, fold_conv_bn_modules
from .passes.report.live import running_fused_modules as fused_modules
from .passes.report.outcome import BNOutcome
from .passes.report.convert_report import ConvertReport

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "BNOutcome",
    "BatchFit",
    "ConvertPlan",
    "ConvertReport",
    "ConvertStrategy",
    "FoldReport",
    "FusedChain",
    "FusedConvBN1d",
    "FusedConvBN2d",
    "FusedConvBN3d",
    "GradcheckReport",
    "PeakMemory",
    "SavedBytes",
    "Strategy",
    "compile_chains",
    "conv_bn_act",
    "convert",
    "explain",
    "fold",
    "fold_conv_bn_modules",
    "fused_kernels",
    "fused_modules",
    "gradcheck_module",
    "max_batch",
    "peak_memory",
    "saved_bytes",
    "tensor_peak",
    "timeline",
    "Timeline",
    "track_saved",
]


def _strategy_names(kind: str) -> object:
    from .functional import strategies

    return getattr(strategies, kind)


# Note: [one name per concept]
# A strategy's values are one Literal type each (``Strategy``, ``ConvertStrategy``); the tuples
# ``STRATEGIES`` / ``CONVERT_STRATEGIES`` spelled the same sets again and ``LayerMode`` a chain's
# internal subset. The old names still answer, for one release, with a FutureWarning.
__getattr__ = _module_aliases(__name__, {
    "STRATEGIES": (lambda: _strategy_names("STRATEGIES"), "typing.get_args(convbn.Strategy)"),
    "CONVERT_STRATEGIES": (lambda: _strategy_names("CONVERT_STRATEGIES"), "typing.get_args(convbn.ConvertStrategy)"),
    "LayerMode": (lambda: _strategy_names("LayerMode"), "convbn.Strategy"),
})
