"""Errors of lowerflow's executor."""

from ..errors import LoweringError


class ExecutorError(LoweringError):
    """A .pte program cannot be loaded or run by lowerflow's executor."""
