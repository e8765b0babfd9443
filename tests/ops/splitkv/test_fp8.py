"""The dense reader of the split-KV op over an fp8 cache (scales folded into q and the output; one
split for a window), the cases of fp8_cases.py under TRITON_INTERPRET=1 on CPU, one a test."""

import pytest

from ...conftest import run_triton_interpreted
from .fp8_cases import CASES


@pytest.mark.parametrize("case", list(CASES))
def test_splitkv_reads_fp8_cache_triton_interpreter(case):
    r = run_triton_interpreted("-m", "tests.ops.splitkv.fp8_cases", case, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
