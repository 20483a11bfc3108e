"""The engine's own error type."""


class EngineError(RuntimeError):
    """A call in the wrong order (an early ``step()``, a ``backward()`` of a frozen model, ...),
    or a gathered unit that does not match its owners' checksums."""


class CheckpointError(ValueError):
    """Saved engine state that does not fit this model or is incomplete (a missing file or
    piece, another model's parameter names or shapes, files of different checkpoints)."""
