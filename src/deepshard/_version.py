"""deepshard's version, in a module of its own so that modules ``deepshard/__init__.py`` imports can read it
without importing the package they are part of."""
__version__ = "0.1.0"
