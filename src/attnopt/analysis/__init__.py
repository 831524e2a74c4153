"""Measuring attention: hooks, dual deviation, decomposition, column mass, policy views."""

__all__: list[str] = []
