"""Exceptions cupylab raises beyond the builtin TypeError / ValueError."""


class CupylabError(Exception):
    """Base class of cupylab's own exceptions."""


class NoGPUError(CupylabError, RuntimeError):
    """No usable CUDA GPU (or no CuPy) is available to run a kernel."""


class CompileError(CupylabError, RuntimeError):
    """NVRTC rejected a kernel source. The message carries the NVRTC log (file and line)."""

    def __init__(self, message, log="", filename=""):
        super().__init__(message)
        self.log = log
        self.filename = filename
