"""Test-wide settings: GPU tests skip without CUDA; one torch thread pool sized to the machine."""
import os

import pytest
import torch

torch.set_num_threads(len(os.sched_getaffinity(0)))
if not torch.cuda.is_available():
    # Triton reads this when kernels are decorated (at import): without a GPU, kernels run interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
