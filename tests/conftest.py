"""Test-suite setup shared by every test.

Without a CUDA GPU, Triton kernels run through Triton's interpreter on the CPU; that switch must be
set before anything imports triton, so it comes first.  tests/gpu/ is skipped, with a reason that
says where to run it.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402  (after the TRITON_INTERPRET switch on purpose)
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and machine: a CI run cannot fail on a draw
# the previous run never made.  Explore with fresh draws locally: HYPOTHESIS_PROFILE=explore.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_GPU_SKIP = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: python -m pytest tests/gpu)")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    for item in items:
        if "tests/gpu/" in item.path.as_posix():
            item.add_marker(_GPU_SKIP)
