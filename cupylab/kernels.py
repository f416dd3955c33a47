"""Bring your own kernel: users' CUDA kernels through cupylab's machinery.

What the seed did with a hand-written C extension and a torch build (``vector_add.cu`` bound
through the Python C-API) takes three lines here::

    mod = cupylab.load_kernels("vector_add.cu")          # parse, compile lazily, cache on disk
    k = mod["vector_add"]                                  # signature parsed from the source
    k.launch_1d(n, x, y, out, n)                           # any GPU arrays, caller's stream

The pieces are cupylab's own: :class:`cupylab._compile.Program` (NVRTC through CuPy, the
persistent binary cache keyed on source, included headers, options, arch and NVRTC version),
:func:`cupylab._arrays.as_view` (the zero-copy argument normaliser),
:class:`cupylab._launch.Kernel` (struct-packed arguments, ``cuLaunchKernel`` on the caller's
stream) and :func:`cupylab._elementwise_core.prepare_call` (NumPy-style operands and output
allocation in the caller's framework). This module adds what a *user's* kernel needs on top:

* a small C++ declaration scanner that finds ``__global__`` functions (``extern "C"``, in
  ``extern "C" { }`` blocks, in namespaces, templated) and reads their parameter lists, so that
  every scalar is packed at the width its C type needs — CuPy's ``RawKernel`` passes a Python
  ``int`` as 64 bits and checks nothing, which silently shifts every later argument;
* per-parameter checks: pointer parameters take GPU arrays whose dtype matches the pointee
  (``float*`` refuses a float64 array), read-only arrays (JAX) only go to ``const`` pointers,
  scalar parameters take range-checked Python/NumPy scalars, the argument count must match;
* :class:`ElementwiseKernel`, which turns a kernel of the form ``k(out, in..., n)`` into a
  NumPy-style function returning the caller's array type.

All argument checks run before any GPU call (they are CPU-testable with fake CUDA Array
Interface objects); nothing is launched when one fails.

This module is the public face; the work is split by job: :mod:`cupylab._cparse` (the
declaration scanner), :mod:`cupylab._kparams` (C types, scalar conversion, signatures),
:mod:`cupylab._kmodule` (:func:`load_kernels`, :class:`KernelModule`), :mod:`cupylab._kernel`
(:class:`Kernel`, the launch) and :mod:`cupylab._ewkernel` (:class:`ElementwiseKernel`).
"""
from ._cparse import parse_kernels
from ._ewkernel import C_TYPE_NAMES, ElementwiseKernel
from ._kernel import BLOCKS_PER_SM_1D, Kernel
from ._kmodule import KernelModule, KernelNotFoundError, cuda_include_dir, load_kernels
from ._kparams import Param, Signature, parse_signature

__all__ = ["load_kernels", "KernelModule", "Kernel", "ElementwiseKernel", "Signature", "Param",
           "KernelNotFoundError", "parse_kernels", "parse_signature", "cuda_include_dir",
           "C_TYPE_NAMES", "BLOCKS_PER_SM_1D"]
