"""deepshard's version, in a module of its own so that modules ``deepshard/__init__.py`` imports can read it
without importing the package they are part of."""
__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))
__git_hash__ = "unknown"
"""The commit deepshard was built from (not recorded: an editable install has none)."""
__git_branch__ = "unknown"
