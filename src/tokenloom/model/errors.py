"""The one exception the model path raises for a file it cannot load."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded: missing, malformed, of an unsupported
    architecture or quantization, or with a tensor missing or of the wrong shape. The message names
    the file, the tensor (when there is one) and what was expected."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path (or a file the model needs inside it) does not exist."""
