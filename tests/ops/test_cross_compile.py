"""The Triton kernels build for sm_90 (the H200) from this CPU machine: ptxas reports their
registers and shared memory (no GPU needed; the Triton wheel's NVIDIA backend compiles)."""

import pytest
import torch

pytest.importorskip("triton")

from orthros.ops.cross_compile import OPTIONS, compile_for, signature  # noqa: E402
from orthros.bench.lowbit_launches import lowbit_launch  # noqa: E402
from orthros.ops.splitkv.lowbit import _kernel  # noqa: E402

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
    assert plan.meta["VDQ"] == plan.meta["PLANAR"]  # the values dequantized wherever the bit-plane loop runs
    assert plan.meta["F16"] == plan.meta["PLANAR"] and plan.meta["PTX"]  # in fp16, levels by inline PTX
    r = compile_for(_kernel(), plan.args, plan.meta)
    assert 0 < r["registers"] <= 255 and 0 < r["shared_bytes"] <= H200_SHARED, r


@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_lowbit_kernel_with_values_dequantized_builds_for_sm90(kv):
    """The dequantizing loop in its earlier form (keys folded into q, values in fp32) still builds."""
    plan = lowbit_launch(kv, dequant_values=True, fp16_dequant=False)
    assert plan.meta["PLANAR"] and plan.meta["VDQ"] and not plan.meta["F16"]
    r = compile_for(_kernel(), plan.args, plan.meta)
    assert 0 < r["registers"] <= 255 and 0 < r["shared_bytes"] <= H200_SHARED, r
    with pytest.raises(ValueError, match="bit-plane loop"):
        lowbit_launch(kv, planar=False, dequant_values=True)
    with pytest.raises(ValueError, match="dequantizing bit-plane loop"):
        lowbit_launch(kv, dequant_values=False, fp16_dequant=True)


def test_signature_types_every_argument():
    plan = lowbit_launch("int2")
    sig, const, attrs = signature(_kernel(), plan.args, {k: v for k, v in plan.meta.items() if k not in OPTIONS})
    assert sig["Q"] == "*bf16" and sig["KQ"] == "*u8" and sig["O"] == "*fp32" and sig["M"] == "i32"
    assert sig["qscale"] == "fp32" and sig["PLANAR"] == "constexpr" and const["KBITS"] == 2
    with pytest.raises(ValueError, match="positional arguments"):
        signature(_kernel(), plan.args[:-1], plan.meta)


def test_signature_is_specialized_as_a_gpu_launch():
    """Regression: builds without the launch's specialization (16-byte alignment, integers
    divisible by 16, integers equal to 1 as constants) loaded fp8 keys one byte at a time and
    did not pipeline them, unlike the kernel that runs (reports were of another build)."""
    from orthros.ops.splitkv import splitkv_attention

    q = torch.zeros(1, 2, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    (kern, args, meta), *_ = _launches_of(splitkv_attention, q, k, k, torch.tensor([[4094, 4095]]),
                                          torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 4096, dtype=torch.long),
                                          window=128, window_rows=1)
    sig, const, attrs = signature(kern, args, {k: v for k, v in meta.items() if k not in OPTIONS})
    names = list(kern.arg_names)
    div16 = {names[i] for (i,), a in attrs.items() if ["tt.divisibility", 16] in a}
    assert {"Q", "K", "V", "sks", "skh"} <= div16, div16  # strides 1024 and 128
    assert "M" not in div16 and sig["window_rows"] == "constexpr" and const["window_rows"] == 1
    assert meta["F16"]  # fp8 keys, bf16 queries: fp16 dots by default


def _launches_of(fn, *args, **kwargs):
    from orthros.ops.cross_compile import captured_launches

    with captured_launches() as launches:
        fn(*args, **kwargs)
    assert launches, f"{fn.__name__} launched no kernel"
    return launches


def test_every_kernel_builds_for_sm90():
    """Each Triton kernel, as its op launches it (bf16; fp8 keys for split-KV and the paged pool):
    split-KV and its merge, paged attention, the row-wise kernels and their backward kernels."""
    from orthros.ops import rowwise, rowwise_grad
    from orthros.ops.splitkv.paged import paged_attention_kernel
    from orthros.ops.splitkv import splitkv_attention

    bf = dict(dtype=torch.bfloat16)
    q, k = torch.zeros(1, 2, 8, 64, **bf), torch.zeros(1, 300, 2, 64, **bf)
    slot, doc, kdoc = torch.tensor([[298, 299]]), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 300,
                                                                                                 dtype=torch.long)
    launches = _launches_of(splitkv_attention, q, k, k, slot, doc, kdoc, window=16, window_rows=1, num_splits=3)
    f8 = k.to(torch.float8_e4m3fn)
    launches += _launches_of(splitkv_attention, q, f8, f8, slot, doc, kdoc, num_splits=3, block_n=128)
    pool = torch.zeros(64 * 16, 2, 64, **bf)
    table, pos = torch.zeros(3, 8, dtype=torch.int32), torch.tensor([5, 40, 100])
    launches += _launches_of(paged_attention_kernel, torch.zeros(3, 8, 64, **bf), pool, pool, table, pos, 16,
                             keys_per_split=64)
    x, w = torch.zeros(4, 7, 256, **bf), torch.ones(256, **bf)
    launches += _launches_of(rowwise.rms_norm, x, w, 1e-6, x)
    cos = torch.ones(1, 7, 1, 64, **bf)
    a = torch.ones(512, **bf)
    launches += _launches_of(rowwise.heads, torch.zeros(4, 7, 512, **bf), cos, cos, 8, 64, a, a, torch.ones(64, **bf),
                             1e-6)
    launches += _launches_of(rowwise.silu_mul, x, x)
    launches += _launches_of(rowwise_grad._norm_backward, x, w, 1e-6, x, x)
    xh, nw = torch.zeros(4, 7, 512, **bf), torch.ones(64, **bf)
    ctx = type("Ctx", (), dict(saved_tensors=(xh, cos, cos, a, a, nw), cfg=(8, 64, 1e-6), needs_input_grad=[True] * 9))
    launches += _launches_of(rowwise_grad._Heads.backward, ctx, torch.zeros(4, 7, 8, 64, **bf))
    names = set()
    for kernel, args, meta in launches:
        r = compile_for(kernel, args, meta)
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= H200_SHARED, (kernel.__name__, r)
        names.add(kernel.__name__)
    assert names == {"splitkv_fwd", "splitkv_merge", "paged_fwd", "rms_norm_fwd", "heads_fwd", "silu_mul_fwd",
                     "rms_norm_bwd", "heads_bwd"}, names


def test_a_long_prompt_compiles_no_new_paged_or_merge_kernel():
    """The paged reader and the merge are specialized alike (Triton's cache key: signature,
    constants, attributes) for every table width and split count a request's length brings, so
    the first long prompt after a server's warm-up compiles nothing. SmolLM2's 9 heads make the
    partials' strides vary with the split count too."""
    from orthros.ops.splitkv.paged import paged_attention_kernel

    bf = dict(dtype=torch.bfloat16)
    pool = torch.zeros(64 * 16, 3, 64, **bf)
    keys = set()
    for width, per, rows in ((5, 64, 2), (8, 64, 2), (17, 64, 2), (40, 128, 2), (64, 64, 2), (16, 64, 1)):
        table, pos = torch.zeros(rows, width, dtype=torch.int32), torch.full((rows,), width * 16 - 1)
        launches = _launches_of(paged_attention_kernel, torch.zeros(rows, 9, 64, **bf), pool, pool, table, pos, 16,
                                keys_per_split=per)
        assert [k.__name__ for k, _, _ in launches] == ["paged_fwd", "splitkv_merge"], width
        for kernel, args, meta in launches:
            sig, const, attrs = signature(kernel, args, {k: v for k, v in meta.items() if k not in OPTIONS})
            keys.add((kernel.__name__, repr(sig), repr(sorted(const.items())), repr(sorted(attrs.items()))))
    assert sorted(k[0] for k in keys) == ["paged_fwd", "splitkv_merge"], keys


def test_fused_moe_kernels_build_for_sm90():
    """The fused MoE step's two kernels as a decode step launches them: bf16, the Qwen3-30B-A3B
    expert shape (C 2048, I 768, k 8), 1 and 64 rows."""
    from orthros.ops.moe import fused_moe

    C, I, E, k = 2048, 768, 16, 8
    bf = dict(dtype=torch.bfloat16)
    tables = (*(torch.zeros(E, dtype=torch.int64) for _ in range(3)), torch.zeros(8, **bf))  # bf16 weights
    for R in (1, 64):
        experts = torch.arange(R * k).reshape(R, k) % E
        launches = _launches_of(fused_moe, torch.zeros(R, C, **bf), torch.rand(R, k), experts, tables, I)
        assert [kern.__name__ for kern, _, _ in launches] == ["moe_up", "moe_down"]
        for kernel, args, meta in launches:
            r = compile_for(kernel, args, meta)
            assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= H200_SHARED, (kernel.__name__, R, r)


def test_splitkv_register_cap_reaches_the_build():
    """`splitkv_attention(maxnreg=...)` caps the sm_90 build: fp8 keys, Llama-3.1-8B shape, the
    decode pair, 64-key tiles, 4 warps: at most 168 registers (3 programs an SM), with little
    spilled (none with the pinned Triton, 56 B with 3.9)."""
    from orthros.ops.cross_compile import compile_for
    from orthros.ops.splitkv import splitkv_attention

    S = 4096
    q = torch.zeros(1, 2, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, S, 8, 128, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    args = (q, k, k, torch.tensor([[S - 2, S - 1]]), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, S, dtype=torch.long))
    kw = dict(window=128, window_rows=1, num_splits=4, block_n=64, num_warps=4, num_stages=3)
    (kern, a, meta), *_ = _launches_of(splitkv_attention, *args, **kw, maxnreg=168)
    assert meta["maxnreg"] == 168
    r = compile_for(kern, a, meta)
    assert r["registers"] <= 168 and r["spill_bytes"] <= 128, r
    (kern, a, meta), *_ = _launches_of(splitkv_attention, *args, **kw)
    assert "maxnreg" not in meta and compile_for(kern, a, meta)["registers"] > 168


@pytest.mark.parametrize("kv, shape, pipe", [("int4", (32, 8, 128), True), ("int2", (32, 8, 128), True),
                                             ("k4v2", (32, 8, 128), True), ("int4", (32, 8, 128), False),
                                             ("int4", (9, 3, 64), False), ("int2", (9, 3, 64), False)])
def test_gluon_packed_kernel_builds_for_sm90(kv, shape, pipe):
    """The Gluon packed kernel (Llama-3.1-8B and SmolLM2 attention shapes) builds and keeps its loop's
    data in registers: no local memory (ptxas may spill a few bytes outside the loop), and shared memory
    only for the copies a tile ahead (pipe: cp.async, then reads into the operand layouts, two barriers
    a tile); without them none and no barrier (a layout conversion through shared memory slipping into
    the loop would show here); no call (a 64-bit division in the loop compiled to one). The tensor-core products are the design's: a 64-slot
    tile is 8 plane products a 16-slot sub-tile for the keys (32), 8 for the bias (q.z), and 4 a value
    group and sub-tile (32 at head size 128)."""
    pytest.importorskip("triton.experimental.gluon")
    from orthros.ops.cross_compile import build, main_loop_sass, ptxas_report
    from orthros.bench.lowbit_launches import gluon_packed_launch

    H, Hkv, D = shape
    kernel, grid, args, meta = gluon_packed_launch(kv, H, Hkv, D, pipe=pipe)
    compiled = build(kernel, args, meta)
    r = ptxas_report(compiled.asm["ptx"])
    assert 0 < r["registers"] <= 255 and r["spill_bytes"] <= 16, r
    n, ops = main_loop_sass(compiled)
    assert not {"STL", "LDL", "STS", "CALL"} & set(ops), ops
    if pipe:
        assert ops["LDGSTS"] > 0 and ops["BAR"] == 2 and ops["LDS"] > 0, ops
        assert 0 < compiled.metadata.shared <= 20 * 1024  # two stages of a 64-slot tile
        assert "LDG" not in ops, ops
    else:
        assert compiled.metadata.shared == 0 and not {"BAR", "LDS", "LDSM", "LDGSTS"} & set(ops), ops
    NG = D // 64
    assert ops["HMMA"] == 4 * 8 * D // 128 + 8 * D // 128 + 4 * NG * 4, ops


@pytest.mark.parametrize("kv, D", [("int4", 128), ("int2", 128), ("k4v2", 64)])
def test_decode_write_kernel_builds_for_sm90(kv, D):
    """The low-bit cache's decode write (`ops/lowbit/write.py`) as the cache launches it, for sm_90."""
    from orthros.models import OrthrosConfig
    from orthros.models.lowbit_cache import LowBitStaticCache
    from orthros.ops.lowbit.write import decode_write

    cfg = OrthrosConfig.from_name("tiny", num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=D, window_size=128)
    c = LowBitStaticCache(cfg, 1, 1024, "cpu", torch.bfloat16, kv)
    x = torch.zeros(1, 1, 8, D, dtype=torch.bfloat16)
    vs, vz = c._v_head_major
    launches = _launches_of(decode_write, x, x, c.rk[0], c.rv[0], c.sk[0], c.sv[0], c.kq[0], c.vq[0], c.k_scale[0],
                            c.k_zero[0], vs[0], vz[0], c.slot, c.recent, c.key_group, c.key_bits, c.value_bits, True)
    (kernel, args, meta), = launches
    r = compile_for(kernel, args, meta)
    assert kernel.__name__ == "lowbit_decode_write_fwd"
    assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= H200_SHARED, r


def test_gluon_path_triton_launches_build_for_sm90():
    """The Gluon path's Triton launches as it makes them: the bf16 splits (sinks and ring, q R written for
    the packed kernel) and the merge (4 bf16 splits; the packed sum rotated by the fast transform), for sm_90."""
    from orthros.ops.lowbit import rotation_matrix
    from orthros.ops.splitkv.lowbit import bf16_split, finish

    plan = lowbit_launch("int4")  # a one-layer 8B-shaped cache and its decode pair
    q, sk, sv, kq, vq, ks, kz, vs, vz, rk, rv, slot, qd, kd, bound, o, lse = (plan.args[0], *plan.args[2:18])
    o = torch.empty(1, 9, *o.shape[2:])
    lse = torch.empty(1, 9, *lse.shape[2:])
    launches = _launches_of(bf16_split, q, sk, sv, kq, vq, ks, kz, vs, vz, rk, rv, slot, qd, kd, bound, 1000, 4, 4,
                            64, o, lse, window=128, window_rows=1, rotation=rotation_matrix(128))
    launches += _launches_of(finish, o, lse, 1, rotation_matrix(128), torch.bfloat16, 4)
    assert [k.__name__ for k, _, _ in launches] == ["splitkv_lowbit_fwd", "lowbit_finish"]
    assert launches[0][2]["NO_PACKED"] and launches[0][2]["HB"] == 128 and launches[1][2]["NB"] == 4
    for kernel, args, meta in launches:
        r = compile_for(kernel, args, meta)
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= H200_SHARED, (kernel.__name__, r)
