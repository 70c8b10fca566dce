"""Worked examples of user code (not part of the installed package)."""
