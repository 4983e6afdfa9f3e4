"""The error of a model the trace cannot capture (a leaf: every tracing module raises it)."""


class TraceError(RuntimeError):
    """The model cannot be captured as one static graph; the message names the model line."""
