"""torch integration for cupylab, imported only on request (``import cupylab`` never imports
this package or torch).

Modules
-------
functional
    Differentiable, torch.compile-friendly functions over cupylab's kernels (softmax, norms,
    cross-entropy, elementwise arithmetic); importing it registers ``torch.ops.cupylab.*``
    (:mod:`cupylab.torch._library`; backward formulas in :mod:`cupylab.torch._autograd`,
    launches in :mod:`cupylab.torch._kernels`).
optim
    Drop-in ``torch.optim`` optimizers (Adam, AdamW, SGD subclass torch's own, so their
    ``state_dict`` loads into torch's optimizers and back; Lion) whose step is one cupylab
    multi-tensor launch per dtype group.
nn
    Drop-in ``torch.nn`` modules (RMSNorm, LayerNorm, Softmax, LogSoftmax, CrossEntropyLoss,
    subclasses of torch's) computed by cupylab's row-wise kernels, and ``swap_modules`` to
    switch an existing model's modules in place.
"""
