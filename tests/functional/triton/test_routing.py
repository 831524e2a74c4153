"""Routing to the Triton backend: who asks for it, and the errors where it cannot run."""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.functional import triton as gpu
from tests.functional.triton._helpers import DEVICE


def test_wanted_follows_the_backend_switch_and_the_device():
    x = torch.zeros(2, 3)
    assert gpu.wanted(x) == (x.is_cuda and gpu.available())  # auto: CUDA tensors only
    with attnopt.backend("triton"):
        assert gpu.wanted(x)
    with attnopt.backend("reference"):
        assert not gpu.wanted(torch.zeros(2, 3, device=DEVICE))
    assert not gpu.wanted("not a tensor")  # the op's own validation reports bad inputs


def test_check_device_names_the_fix():
    cpu = torch.zeros(1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gpu.check_device(cpu, interpreted=False)
    gpu.check_device(cpu, interpreted=True)  # the interpreter runs CPU tensors


def test_cpu_backends_are_untouched_by_default():
    """Outside attnopt.backend("triton") a CPU call never takes the Triton path."""
    from attnopt.functional import dispatch
    from attnopt.functional.doubly_normalized import doubly_normalized_attention

    q = torch.randn(1, 1, 8, 4)
    doubly_normalized_attention(q, q, q)
    assert dispatch.last_dispatch["doubly_normalized"] != "triton"
