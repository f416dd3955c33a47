"""NumPy-style wrappers of users' elementwise kernels (for :mod:`cupylab.kernels`)."""
from __future__ import annotations

from . import _arrays, _kfast, _launch
from ._elementwise_core import c_strides, finish_output, prepare_call, wait_producers
from ._kernel import _MAX_GRID_X, Kernel, _block, _readonly_msg
from ._kmodule import KernelModule
from ._kparams import _BYTE_POINTEES, PAIR_POINTEES

__all__ = ["ElementwiseKernel", "C_TYPE_NAMES"]


#: C spellings substituted for ``{T}`` in :class:`ElementwiseKernel` name patterns.
C_TYPE_NAMES = {
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
    "int32": "int", "int64": "long long", "bool": "bool", "int8": "signed char",
    "int16": "short", "uint8": "unsigned char", "uint16": "unsigned short",
    "uint32": "unsigned int", "uint64": "unsigned long long",
}
_INT_FMTS = frozenset("bBhHiIlLqQnN")


def untyped_ok(p):
    """Whether an untyped pointer parameter ``p`` (no dtype) may take an array here: raw
    memory (void*, char*) is indexed as the arrays' elements by the kernel's own casts."""
    return p.ctype in _BYTE_POINTEES and "*" not in p.decl.replace("*", "", 1)


class ElementwiseKernel:
    """Turn a user kernel of the form ``k(out, in..., n)`` into a NumPy-style function.

    The wrapped function takes the kernel's other parameters (arrays for pointer parameters,
    scalars for scalar ones) in signature order, allocates the output in the caller's
    framework (torch in → torch out, CuPy → CuPy, JAX → JAX, Numba → Numba; other CAI/DLPack
    → CuPy), or writes ``out=``, and launches ``ceil(n / block)`` blocks of ``block`` threads
    on the caller's stream — enough for both one-thread-per-element kernels (``if (i < n)``)
    and grid-stride loops.

    Rules: at least one array operand; all arrays and the output share one dtype (no
    promotion); every array has the output's shape and is C-contiguous, because the kernel
    indexes linearly (broadcast or strided views are refused with a hint, never copied); the
    size parameter receives the element count, range-checked for its C type (an ``int n``
    refuses more than 2**31 - 1 elements). A read-only (JAX) array cannot go to a non-const
    pointer; ``out=`` must be writable.

    Parameters
    ----------
    kernel : Kernel or KernelModule
        A kernel (one fixed instance), or a module together with ``name``.
    name : str, optional
        With a module: a kernel name, or a pattern with ``{T}`` (``"axpby<{T}>"``) that is
        instantiated per dtype with the C spelling from :data:`C_TYPE_NAMES` (float32 →
        ``float``, float16 → ``__half``, ...; ``type_names`` overrides).
    out : str, optional
        Name of the output pointer parameter. Default: the only non-const pointer parameter.
    size : str, optional
        Name of the element-count parameter. Default: the last parameter, if it is an integer.
    block : int
        Threads per block.
    type_names : dict, optional
        dtype name → C spelling for ``{T}`` (e.g. ``{"float16": "my_half"}`` with
        ``typedef __half my_half;`` in the source: an alias of a type cupylab knows; a
        struct is refused as an array element, its size being unknown).

    Raises
    ------
    TypeError, ValueError
        At construction, when ``out``/``size`` cannot be determined or do not name suitable
        parameters. At call time, as documented for :meth:`__call__`.

    Examples
    --------
    >>> mod = cupylab.load_kernels("fused.cu")               # template <typename T> ...
    >>> fam = cupylab.ElementwiseKernel(mod, "fused_add_mul<{T}>")
    >>> d = fam(a, b, 3.0)                                     # torch in -> torch out
    """

    def __init__(self, kernel, name=None, *, out=None, size=None, block=256, type_names=None):
        if isinstance(kernel, Kernel):
            if name is not None:
                raise TypeError("ElementwiseKernel: give name= only together with a "
                                "KernelModule")
            self._module, self._pattern, proto = kernel.module, None, kernel
        elif isinstance(kernel, KernelModule):
            if not isinstance(name, str):
                raise TypeError("ElementwiseKernel(module, name): name must be a kernel name "
                                "or a pattern such as 'axpby<{T}>'")
            self._module = kernel
            if "{T}" in name:
                self._pattern = name
                proto = kernel[name.replace("{T}", "float")]
            else:
                self._pattern, proto = None, kernel[name]
        else:
            raise TypeError(f"ElementwiseKernel needs a cupylab Kernel or KernelModule (got "
                            f"{_arrays._what(kernel)})")
        self._fixed = proto if self._pattern is None else None
        self._names = dict(C_TYPE_NAMES, **(type_names or {}))
        self._instances = {}
        b = _block(block)
        if b[1] != 1 or b[2] != 1:
            raise ValueError(f"ElementwiseKernel takes a 1-D block (got {block!r})")
        self.block = b[0]
        self._max_n = _MAX_GRID_X * self.block  # more elements need more blocks than CUDA has
        self._lean = {}  # type of the array operands -> _kfast.EwPattern
        self._lean_call = None  # the pattern used last: tried first
        params = proto.signature.params
        self.name = (self._pattern or proto.name).replace("<{T}>", "").replace("{T}", "")
        self._out = self._find(params, out, "out", lambda p: p.pointer and not p.const,
                               "a non-const pointer")
        self._size = self._find(params, size, "size",
                                lambda p: not p.pointer and p.fmt in _INT_FMTS,
                                "an integer scalar")
        if self._out == self._size:
            raise ValueError(f"{self.name}: out and size name the same parameter")
        self._operands = [p.index for p in params if p.index not in (self._out, self._size)]
        self._labels = [params[i].name or f"#{i}" for i in self._operands]
        self._ptr = [params[i].pointer for i in self._operands]
        self._nonconst_in = [params[i].pointer and not params[i].const for i in self._operands]
        self._nparams = len(params)
        self.__doc__ = (f"NumPy-style wrapper of {proto.signature}: call with "
                        f"({', '.join(self._labels)}, out=None, stream=None).")

    def _find(self, params, given, what, ok, kind):
        if given is not None:
            for p in params:
                if p.name == given:
                    if not ok(p):
                        raise ValueError(f"{self.name}: {what}={given!r} names {p.decl}, which "
                                         f"is not {kind}")
                    return p.index
            raise ValueError(f"{self.name}: {what}={given!r} is not a parameter of "
                             f"{self._module and self._example()}")
        if what == "out":
            cands = [p for p in params if ok(p)]
            if len(cands) != 1:
                raise ValueError(
                    f"{self.name}: cannot tell which parameter is the output ("
                    f"{len(cands)} non-const pointers); pass out='<parameter name>'")
            return cands[0].index
        if params and ok(params[-1]):
            return params[-1].index
        raise ValueError(f"{self.name}: the last parameter is not an integer element count; "
                         "pass size='<parameter name>'")

    def _example(self):
        return self._fixed.signature if self._fixed is not None else self._pattern

    def _instance(self, dt):
        k = self._fixed
        if k is None:
            k = self._instances.get(dt.name)
            if k is None:
                cname = self._names.get(dt.name)
                if cname is None:
                    raise TypeError(f"{self.name}: no C type for dtype {dt.name}; pass "
                                    f"type_names={{'{dt.name}': '<C type>'}}")
                k = self._instances[dt.name] = self._module[self._pattern.replace("{T}", cname)]
        for p in k.signature.params:
            if p.pointer and p.dtype is not None and p.dtype is not dt:
                raise TypeError(f"{p.what} needs {p.dtype.name} arrays but the arrays are "
                                f"{dt.name}")
            if p.pointer and p.dtype is None and PAIR_POINTEES.get(p.ctype) not in (None,
                                                                                  dt.name):
                raise TypeError(f"{p.what} needs {PAIR_POINTEES[p.ctype]} arrays (one element a "
                                f"{p.ctype}) but the arrays are {dt.name}")
            if (p.pointer and p.dtype is None and p.ctype not in PAIR_POINTEES
                    and not untyped_ok(p)):
                # the element count is the arrays' size: a pointee of another size (float4,
                # a struct, a pointer) would be indexed past the arrays' end
                raise TypeError(f"{p.what}: ElementwiseKernel cannot tell how many "
                                f"{p.ctype} elements an array holds; use a pointer to the "
                                "element type (float*, double*, float2* for complex64, ...) "
                                "or a Kernel with an explicit count")
        return k

    def __call__(self, *args, out=None, stream=None):
        """Run the kernel elementwise over its array operands.

        Parameters
        ----------
        *args
            The kernel's parameters other than the output and the size, in signature order:
            GPU arrays for pointers, Python/NumPy scalars for scalars.
        out : GPU array, optional
            Where to write: writable, C-contiguous, of the operands' shape and dtype; may be
            exactly one of the inputs.
        stream : optional
            Stream override (default: the caller's current stream).

        Returns
        -------
        array
            ``out`` if given, else a new array in the first array operand's framework.

        Raises
        ------
        TypeError
            Wrong operand count, host arrays, dtypes that differ or do not match the kernel's
            pointer types, scalar type errors.
        ValueError
            Shapes that differ, non-contiguous or broadcast operands, a read-only array for
            a non-const pointer, a bad ``out``, arrays on different GPUs.
        OverflowError
            A scalar, or the element count, out of range for its C type.
        """
        call = self._lean_call
        if call is not None:
            r = call(args, out, stream)  # the lean path: cupylab._kfast
            if r is not _kfast.MISS:
                return r
        r, k = self._call_checked(args, out, stream)
        if k is not None:
            self._learn(k, args, out)
        return r

    def _learn(self, k, args, out):
        """After a full-path call that launched ``k``: keep the lean pattern of ``args``."""
        tp = type(args[self._ptr.index(True)])
        pat = self._lean.get(tp)
        if pat is None:
            pat = _kfast.EwPattern.make(self, args, out)
            if pat is None:
                return
            self._lean[tp] = pat
        pat.learn(k, args)
        self._lean_call = pat.call

    def _call_checked(self, args, out, stream):
        """The full path (:func:`cupylab._elementwise_core.prepare_call` and every check);
        returns the result and the kernel instance used (None when nothing was launched)."""
        nop = len(self._operands)
        if len(args) != nop:
            raise TypeError(f"{self.name}() takes {nop} operand{'' if nop == 1 else 's'} "
                            f"({', '.join(self._labels)}) (got {len(args)})")
        arrays, anames, aidx, scal = [], [], [], []
        for j, a in enumerate(args):
            if self._ptr[j]:
                if self._nonconst_in[j] and _arrays.framework_of(a) is _arrays._from_jax:
                    raise ValueError(_readonly_msg(self._proto_param(j), "jax"))
                arrays.append(a)
                anames.append(self._labels[j])
                aidx.append(self._operands[j])
            else:
                scal.append((self._operands[j], a))
        chosen = []

        def dtype_check(dt):
            if dt is None:
                return
            k = self._instance(dt)
            ps = k.signature.params
            vals = [(i, ps[i].convert(a, ps[i].what)) for i, a in scal]
            chosen[:] = [k, vals]

        c = prepare_call(self.name, arrays, out=out, stream=stream, names=anames,
                         allow_scalars=[False] * len(arrays), dtype_check=dtype_check)
        k, svals = chosen
        shape = c.shape
        cs = c_strides(shape)
        for v, label, i in zip(c.views, anames, aidx):
            if not _c_contig(v, shape, cs):
                raise ValueError(
                    f"{self.name}: {label} has shape {v.shape} and strides {v.strides} "
                    f"(elements); this kernel indexes linearly, so every operand must be "
                    f"C-contiguous with the output's shape {shape}. Make it contiguous first "
                    "(tensor.contiguous(), cupy.ascontiguousarray, or broadcast explicitly)")
            if v.readonly and not k.signature.params[i].const:
                raise ValueError(_readonly_msg(k.signature.params[i], v.kind))
        if not _c_contig(c.out, shape, cs):
            raise ValueError(f"{self.name}: out must be C-contiguous (strides {c.out.strides})")
        n = c.size
        if n:
            ps = k.signature.params
            values = [None] * self._nparams
            values[self._out] = c.out.ptr
            for v, i in zip(c.views, aidx):
                values[i] = v.ptr
            for i, val in svals:
                values[i] = val
            values[self._size] = ps[self._size].convert(n, ps[self._size].what)
            grid = -(-n // self.block)
            if grid > _MAX_GRID_X:
                raise ValueError(f"{self.name}: {n} elements need more than {_MAX_GRID_X} "
                                 "blocks; use a larger block")
            with _launch.ensure_device(c.device):
                wait_producers(c)  # the inputs' CAI v3 streams, and a given out's
                k._k.launch(c.device, grid, self.block, c.stream, values)
        else:
            k = None
        return (finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated
                else c.out_obj), k

    def _proto_param(self, j):
        proto = self._fixed or next(iter(self._instances.values()), None)
        if proto is None:
            proto = self._module[self._pattern.replace("{T}", "float")]
        return proto.signature.params[self._operands[j]]

    def __repr__(self):
        return f"<cupylab.ElementwiseKernel {self._example()}>"


def _c_contig(v, shape, cs):
    if v.shape != shape:
        return False
    if 0 in shape:  # nothing to index: any strides will do (CuPy reports zeros here)
        return True
    return all(s == e for s, e, n in zip(v.strides, cs, shape) if n > 1)
