"""cupylab: hand-written CUDA kernels for arrays from any framework.

Kernels live in ``cuda_src/*.cu``, are compiled at run time with NVRTC (through CuPy), cached on
disk, and wrapped as NumPy-style functions that take CuPy, torch, JAX, Numba, CAI or DLPack
arrays zero-copy, launch on the caller's current stream and return the caller's array type.

``import cupylab`` imports neither CuPy, torch nor JAX; CuPy is loaded on the first launch.
"""
from ._errors import CompileError, CupylabError, NoGPUError
from ._dtypes import ARITHMETIC as _ARITH
from ._graph import Graph
from .kernels import ElementwiseKernel, Kernel, KernelModule, KernelNotFoundError, load_kernels
from .ops.elementwise import (add, div, divide, floor_divide, fused_add_mul, mul, multiply,
                              prepare, sub, subtract, true_divide, vector_add)

# ---- row-wise operators (issue 15) ----------------------------------------------------------
from .ops.rowwise import (add_rms_norm, layer_norm, layer_norm_backward, log_softmax,
                          log_softmax_backward, rms_norm, rms_norm_backward, softmax,
                          softmax_backward)
from .ops.cross_entropy import cross_entropy, cross_entropy_backward
from .ops.resnorm import add_rms_norm_backward
_ROWWISE = ["softmax", "log_softmax", "layer_norm", "rms_norm", "add_rms_norm", "cross_entropy",
            "softmax_backward", "log_softmax_backward", "layer_norm_backward",
            "rms_norm_backward", "add_rms_norm_backward", "cross_entropy_backward"]
# ---- end row-wise ---------------------------------------------------------------------------

__version__ = "0.1.0"

#: Names of the dtypes the arithmetic operators accept.
dtypes = tuple(d.name for d in _ARITH)

__all__ = [
    "add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "sub", "mul", "div",
    "vector_add", "fused_add_mul", "prepare", "Graph",
    "load_kernels", "KernelModule", "Kernel", "ElementwiseKernel", "KernelNotFoundError",
    "CupylabError", "NoGPUError", "CompileError", "dtypes", "__version__",
] + _ROWWISE

# -- multi-tensor operators and fused optimizers (issue 16) ------------------------------------
# ``cupylab.foreach``: list operators; ``cupylab.optim``: functional fused optimizer steps.
# ``cupylab.torch.optim`` (drop-in torch optimizers) is imported only on request.
from . import foreach, optim  # noqa: E402

__all__ += ["foreach", "optim"]
