"""The package version, in a module of its own so that any layer can read it without importing
``kvferry/__init__.py`` (which reaches up to the engine)."""

__version__ = "0.1.0"
