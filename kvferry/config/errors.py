"""ConfigError: the one exception every check on user settings raises."""


class ConfigError(ValueError):
    """A user-facing configuration error; the message is meant to be shown as is."""
