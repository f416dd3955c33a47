"""foreach operators: one launch over lists of arrays of mixed sizes (and dtypes).

Every function takes lists (or tuples) of GPU arrays from one framework (CuPy, torch, JAX
read-only, Numba, CAI, DLPack), validated once per list and then served from the cache of
:mod:`cupylab.ops._mt_plan` (CuPy and torch lists; other frameworks are validated on every
call). Launches go to the caller's current stream (torch's for torch arrays, CuPy's
otherwise) or ``stream=``; nothing synchronises the host, and the norms, the clip factor and
``found_inf`` stay on the device.

Rules for every function: arrays C-contiguous, float16 / bfloat16 / float32 / float64, the
arrays at one position of every list of the same shape and dtype (``copy_`` converts), all on
one device, all from one framework; torch tensors must not require grad (pass
``p.detach()``); a written array may be the same array as the one it is computed from at its
own position (in place), and must not overlap any other array of the call. Empty lists are a
no-op; empty arrays are skipped. Arithmetic runs in float32 for 16-bit and float32 arrays, in
float64 for float64 arrays.

The operators live in :mod:`cupylab.ops._mt_elementwise` (add, add_, axpy_, mul, mul_,
scale_, lerp, lerp_, copy_, zero_) and :mod:`cupylab.ops._mt_reduce` (norm, norms,
clip_by_global_norm_, nonfinite_check, unscale_), over the argument checks and plan lookup
of :mod:`cupylab.ops._mt_core` (:func:`resolve`, :func:`device_scalar`); :func:`prepare` and
:class:`PreparedForeach` are in :mod:`cupylab.ops._mt_prepare`. This module gathers their
public names (:mod:`cupylab.foreach` is the public face).
"""
from __future__ import annotations

from ._mt_core import device_scalar, resolve
from ._mt_elementwise import add, add_, axpy_, copy_, lerp, lerp_, mul, mul_, scale_, zero_
from ._mt_prepare import PreparedForeach, prepare
from ._mt_reduce import clip_by_global_norm_, nonfinite_check, norm, norms, unscale_

__all__ = ["add", "add_", "axpy_", "mul", "mul_", "scale_", "lerp", "lerp_", "copy_", "zero_",
           "norm", "norms", "clip_by_global_norm_", "nonfinite_check", "unscale_", "prepare",
           "PreparedForeach", "resolve", "device_scalar"]
