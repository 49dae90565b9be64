"""Errors a user can act on. Their message is shown as is (CLI stderr, app banner)."""


class SparsevidError(Exception):
    """Base class: a clear, one-line, user-facing message; never a traceback in the UI."""


class VideoError(SparsevidError):
    """The video cannot be used (unreadable, no stream, no frames, too large, too long)."""


class ModelError(SparsevidError):
    """The model cannot be loaded or is not a supported architecture."""


class InputError(SparsevidError):
    """Bad non-video input: empty or overlong question, bad settings."""
