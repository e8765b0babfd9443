"""Run under TRITON_INTERPRET=1, one named case a process (test_write.py), or on a GPU (`python -m
tests.ops.lowbit.write_cases all cuda`): the low-bit cache's decode write as one Triton launch (`ops/lowbit/write.py`) against its PyTorch form,
bit for bit: the same prompt prefilled, then decode steps written one way and the other, over the bound's
moves (key groups written from the ring), tokens written into the sinks, every cache dtype, rotated or not,
head sizes 16, 24 (block-diagonal rotation, padded tiles), 32 and 64, sinks or none, int4 keys in an int2 cache."""

import sys
from unittest import mock

import torch

import orthros.models.lowbit_cache as lowbit_cache

from tests.ops.splitkv.lowbit_cases import filled_cache


def same_cache(a, b, label):
    """What a read can see of the two caches is bit-identical (the PyTorch form also writes, while the bound is 0,
    a key group nothing reads; those bytes aside, everything is compared)."""
    L = a.length
    bound = a.bound_at(L)
    g = a.key_group
    pairs = {
        "ring K": (a.rk[0], b.rk[0]), "ring V": (a.rv[0], b.rv[0]), "sink K": (a.sk[0], b.sk[0]),
        "sink V": (a.sv[0], b.sv[0]), "packed V": (a.vq[0][:, :L], b.vq[0][:, :L]),
        "V scale": (a.v_scale[0][:, :L], b.v_scale[0][:, :L]), "V zero": (a.v_zero[0][:, :L], b.v_zero[0][:, :L]),
        "packed K": (a.kq[0][:, :bound], b.kq[0][:, :bound]),
        "K scale": (a.k_scale[0][:, : bound // g], b.k_scale[0][:, : bound // g]),
        "K zero": (a.k_zero[0][:, : bound // g], b.k_zero[0][:, : bound // g]),
    }
    for name, (x, y) in pairs.items():
        if not torch.equal(x, y):
            diff = (x != y).nonzero()
            raise AssertionError(f"{label}: {name} differs at {diff.shape[0]} places, first {diff[0].tolist()}")
    ka, va = a.dense(0, L, bound)
    kb, vb = b.dense(0, L, bound)
    assert torch.equal(ka, kb) and torch.equal(va, vb), label


def case(kv_dtype, D, length, sinks, chunks, device, rotate=True):
    label = f"{kv_dtype} D={D} L={length} sinks={sinks} chunks={chunks} rotate={rotate}"
    caches = []
    for kernel in (False, True):
        with mock.patch.object(lowbit_cache, "write_kernel_applies", lambda *a, k=kernel: k):
            cache = filled_cache(kv_dtype, 4, 2, D, length, sinks, chunks, pad=0, seed=1, device=device,
                                 rotate=rotate)
        caches.append(cache)
    prompt = min(sum(chunks), length)
    bound0, bound1 = caches[0].bound_at(prompt), caches[0].bound_at(length)
    assert bound1 > bound0, label  # decode steps moved the bound: key groups written from the ring
    same_cache(*caches, label)


def dtype_cases(device="cpu"):
    """Every cache dtype, head sizes 16, 24 and 64."""
    for kv, D in (("int4", 16), ("int2", 16), ("k4v2", 16), ("int4", 24), ("k4v2", 64)):
        case(kv, D, 64, 4, [36], device)


def edge_cases(device="cpu"):
    case("int2", 16, 40, 4, [2], device)  # tokens written into the sinks by decode steps
    case("int4", 16, 40, 0, [5], device)  # no sinks
    case("int2", 64, 64, 4, [36], device, rotate=False)
    case("int4", 32, 64, 4, [1, 35], device)  # one-token prefill, then a long decode


def key_bits_case(device="cpu"):
    """int4 keys in an int2 cache (the layers of `kv_int4_key_layers`): the kernel takes the layer's key bits."""
    cfg_bits = []
    for kernel in (False, True):
        with mock.patch.object(lowbit_cache, "write_kernel_applies", lambda *a, k=kernel: k), \
                mock.patch.object(lowbit_cache, "layer_key_bits", lambda cfg, kv, kb=None: [4]):
            cfg_bits.append(filled_cache("int2", 4, 2, 16, 64, 4, [36], pad=0, seed=1, device=device))
    assert cfg_bits[0].layer_key_bits == [4] and cfg_bits[0].kq[0].shape[-1] == 8
    same_cache(*cfg_bits, "int2 with int4 keys")


# the interpreter's cases, one process each (tests/ops/lowbit/test_write.py parametrizes over them)
CASES = {"dtypes": dtype_cases, "edges": edge_cases, "key-bits": key_bits_case}


def main(device="cpu"):
    for run in CASES.values():
        run(device)
    print(f"{len(CASES)} groups of write cases bit-identical ({device})")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if which == "all":
        main(dev)
    else:
        CASES[which](dev)
    print("ok")
