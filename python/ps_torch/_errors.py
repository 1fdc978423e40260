"""The package's own exceptions (``ModelMismatchError`` comes from the extension)."""


class GradNoneError(RuntimeError):
    """A trainable parameter has no gradient at ``Worker.step()``."""


class UnsupportedModelError(ValueError):
    """The model has something the cluster cannot keep in step (a parameter that is not
    float32, a buffer or frozen entry of a dtype safetensors cannot hold)."""
