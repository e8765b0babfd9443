"""A low-bit cache's decode write as one Triton launch (`ops/lowbit/write.py`) stores the bits its
PyTorch form stores: the cases of write_cases.py, one named group a test."""

import pytest

from ...conftest import DEVICE, run_triton_interpreted
from .write_cases import CASES


@pytest.mark.parametrize("case", list(CASES))
def test_decode_write_kernel_triton_interpreter(case):
    """Under TRITON_INTERPRET=1 on CPU."""
    r = run_triton_interpreted("-m", "tests.ops.lowbit.write_cases", case, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.long
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU run of the write cases (CI runs them interpreted)")
def test_decode_write_kernel_on_gpu():
    from .write_cases import main

    main("cuda")
