"""The package version, in a module of its own so that every layer can read it without importing the
package's public API (``slimspec_convert/__init__.py`` sits on top of every other module)."""

__version__ = "0.1.0"
