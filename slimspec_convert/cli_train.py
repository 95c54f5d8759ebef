"""CLI commands: train (registered on slimspec_convert.cli.app)."""

from __future__ import annotations

from .cli import app, fail  # noqa: F401
