"""The Triton kernels build for sm_90 (the H200) from this CPU machine: ptxas reports their
registers and shared memory (no GPU needed; the Triton wheel's NVIDIA backend compiles)."""

import pytest
import torch

pytest.importorskip("triton")

from orthros.ops.cross_compile import compile_for, signature  # noqa: E402
from orthros.ops.lowbit_launches import lowbit_launch  # noqa: E402
from orthros.ops.splitkv_lowbit import _kernel  # noqa: E402

H200_SHARED = 227 * 1024


@pytest.mark.parametrize("kv, shape, planar, dtype", [
    ("int4", (32, 8, 128), None, torch.bfloat16),   # Llama-3.1-8B: the bit-plane loop
    ("int2", (32, 8, 128), False, torch.bfloat16),  # the interleaving loop
    ("k4v2", (9, 3, 64), None, torch.bfloat16),     # SmolLM2-135M: int2 keys 16 bytes a slot
    ("int4", (4, 2, 16), None, torch.float16),      # narrow tiles: fp32 dots
])
def test_lowbit_kernel_builds_for_sm90(kv, shape, planar, dtype):
    H, Hkv, D = shape
    plan = lowbit_launch(kv, H, Hkv, D, planar=planar, dtype=dtype)
    assert plan.meta["PLANAR"] == (planar is None and D >= 64)
    r = compile_for(_kernel(), plan.args, plan.meta)
    assert 0 < r["registers"] <= 255 and 0 < r["shared_bytes"] <= H200_SHARED, r


def test_signature_types_every_argument():
    plan = lowbit_launch("int2")
    sig, const = signature(_kernel(), plan.args, {k: v for k, v in plan.meta.items()
                                                  if k not in ("num_warps", "num_stages")})
    assert sig["Q"] == "*bf16" and sig["KQ"] == "*u8" and sig["O"] == "*fp32" and sig["M"] == "i32"
    assert sig["qscale"] == "fp32" and sig["PLANAR"] == "constexpr" and const["KBITS"] == 2
    with pytest.raises(ValueError, match="positional arguments"):
        signature(_kernel(), plan.args[:-1], plan.meta)
