"""Launcher: turns a chosen frontier point into running workers (see the launch issue)."""
