"""The module-level skip of the GPU tests whose kernels are sm_90a only (wgmma, TMA, setmaxnreg): ``require_sm90(what)``
at the top of a test module skips it, naming ``what``, without a CUDA GPU or on one of another compute capability."""

import pytest
import torch


def require_sm90(what: str) -> None:
    if not torch.cuda.is_available():  # (tests/conftest.py skips tests/gpu without a GPU too)
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{what} needs sm_90 (H100 / H200), this GPU is sm_{torch.cuda.get_device_capability()}",
                    allow_module_level=True)
