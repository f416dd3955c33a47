"""torch integration for cupylab, imported only on request (``import cupylab`` never imports
this package or torch).

Modules
-------
optim
    Drop-in ``torch.optim`` optimizers (Adam, AdamW, SGD subclass torch's own, so their
    ``state_dict`` loads into torch's optimizers and back; Lion) whose step is one cupylab
    multi-tensor launch per dtype group.
nn
    Drop-in ``torch.nn`` modules (RMSNorm, LayerNorm, Softmax, LogSoftmax, CrossEntropyLoss,
    subclasses of torch's) computed by cupylab's row-wise kernels, and ``swap_modules`` to
    switch an existing model's modules in place.
"""
