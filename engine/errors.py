"""Typed errors the engine raises; each names the problem so callers (and HTTP) can map it."""


class BatonError(Exception):
    """Base of every error Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """A request's prompt or sampling parameters are invalid; other requests are unaffected."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens it asks for) does not fit in max_model_len."""


class ModelLoadError(BatonError):
    """A model path, config or weights file cannot be loaded."""


class ConfigError(BatonError, ValueError):
    """An engine configuration value is invalid."""
