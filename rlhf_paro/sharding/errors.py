"""The engine's own error type."""


class EngineError(RuntimeError):
    """A call in the wrong order (an early ``step()``, a ``backward()`` of a frozen model, ...),
    or a gathered unit that does not match its owners' checksums."""
