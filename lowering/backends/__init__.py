"""Backends shipped with lowerflow."""
