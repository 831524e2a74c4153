"""Offline data builders for the papers' training experiments (deterministic, no downloads)."""
