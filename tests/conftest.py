"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports
# attnopt's Triton kernels, so that without a GPU they run on CPU tensors (tests/functional/triton)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
