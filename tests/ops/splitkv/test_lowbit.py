"""The low-bit reader of the split-KV op (`ops/splitkv/lowbit.py`) against dequantize-then-attend on
caches written by `LowBitStaticCache` itself: its interpreter cases one named case a test
(lowbit_cases.py), the GPU runs, and where the Gluon kernel refuses to run."""

import pytest
import torch

from orthros.ops.splitkv.lowbit import gluon_applies, gluon_refusal
from orthros.ops.splitkv.study import from_environment, lowbit_splitkv_attention

from ...conftest import DEVICE, run_triton_interpreted
from .lowbit_cases import CASES, GLUON_SHAPES, filled_cache


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_reference_triton_interpreter(case):
    """Each case of lowbit_cases.py (the cache dtypes, the key-group edges, the wide tiles and mixed key
    bits, the Gluon path's merge and bf16 splits: `finish`) under TRITON_INTERPRET=1 on CPU."""
    r = run_triton_interpreted("-m", "tests.ops.splitkv.lowbit_cases", case, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.long
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU run of the kernel cases (CI runs them interpreted)")
@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2"])
def test_kernel_matches_reference_on_gpu(kv_dtype):
    from .lowbit_cases import main

    main("all", "cuda", kvs=(kv_dtype,))


@pytest.mark.long
@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon has no interpreter: its kernel cases need a GPU")
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=[f"D{d}-H{h}-KV{k}" for d, h, k in GLUON_SHAPES])
@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2"])
def test_gluon_kernel_matches_reference_on_gpu(kv_dtype, shape):
    """One item per cache dtype and head shape (each compiles its own kernels): spread over workers."""
    from .lowbit_cases import gluon_cases

    gluon_cases("cuda", (kv_dtype,), (shape,))


def test_gluon_kernel_refuses_what_it_cannot_read():
    """The Gluon packed kernel is never asked for where it cannot run; asking for it says why."""
    cache = filled_cache("int4", 4, 2, 64, 300, 4, [300], 0, 0, key_group=64, value_group=64)
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    why = gluon_refusal(q, cache.k_scale[0], cache.v_scale[0], 64, 4, 4, 0)
    assert "CUDA" in why and not gluon_applies(q, cache.k_scale[0], cache.v_scale[0], 64, 4, 4, 0)
    with pytest.raises(ValueError, match="Gluon packed kernel does not apply: it needs a CUDA GPU"):
        lowbit_splitkv_attention(q, *cache.layer(0), torch.full((2, 1), 299), torch.zeros(2, 1, dtype=torch.long),
                                 cache.doc, torch.tensor([cache.bound_at(300)]), 300, 4, 4, 64,
                                 rotation=cache.rotation, packed_kernel="gluon")
    with pytest.raises(ValueError, match="packed_kernel must be"):
        lowbit_splitkv_attention(q, *cache.layer(0), torch.full((2, 1), 299), torch.zeros(2, 1, dtype=torch.long),
                                 cache.doc, torch.tensor([cache.bound_at(300)]), 300, 4, 4, 64,
                                 rotation=cache.rotation, packed_kernel="cuda")
    with pytest.raises(ValueError, match="ORTHROS_LOWBIT_KERNEL must be 'gluon' or 'triton'"):
        from_environment({"ORTHROS_LOWBIT_KERNEL": "trition"})


def test_study_switches_come_from_the_environment_of_benchmarks_only():
    """The kernel variants of studies are set by `study.from_environment` (benchmark entry points), and
    production defaults are restored by an empty environment."""
    from orthros.ops.splitkv.common import VARIANTS

    try:
        from_environment({"ORTHROS_LOWBIT_KERNEL": "triton", "ORTHROS_FP8_DOTS": "bf16"})
        assert (VARIANTS.lowbit_packed, VARIANTS.fp8_dots) == ("triton", "bf16")
        with pytest.raises(ValueError, match="ORTHROS_FP8_DOTS"):
            from_environment({"ORTHROS_FP8_DOTS": "fp32"})
    finally:
        from_environment({})
    assert (VARIANTS.lowbit_packed, VARIANTS.fp8_dots) == (None, "fp16")
