"""The paged low-bit reader (`ops/splitkv/lowbit_paged.py`) against its gathered, dequantized reference:
the cases of lowbit_paged_cases.py under TRITON_INTERPRET=1 on CPU, one cache dtype a process, and on a GPU."""

import pytest

from ...conftest import DEVICE, run_triton_interpreted


@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2"])
def test_paged_lowbit_kernel_triton_interpreter(kv_dtype):
    r = run_triton_interpreted("-m", "tests.ops.splitkv.lowbit_paged_cases", kv_dtype, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.long
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU run of the kernel cases (CI runs them interpreted)")
def test_paged_lowbit_kernel_on_gpu():
    from .lowbit_paged_cases import main

    main()
