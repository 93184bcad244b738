"""Test-wide settings: GPU tests skip without CUDA; one torch thread pool sized to the machine."""
import os

import pytest
import torch

torch.set_num_threads(len(os.sched_getaffinity(0)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
