"""Integrations with other libraries (Hugging Face transformers, PyTorch Geometric).

Submodules import their optional dependency lazily; importing ``attnopt`` never needs them.
"""
