"""Plugins for serving engines, one room each (STYLE.md section 2): they import the library and the
engine; nothing in the library imports them or any engine."""
