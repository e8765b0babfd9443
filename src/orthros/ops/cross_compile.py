"""Compile a Triton kernel launch for an NVIDIA GPU on a machine without one, and read what
ptxas reports (registers, spills, shared memory): a kernel's build for sm_90 can be checked,
and two variants compared, in CI. It needs only the Triton wheel (its NVIDIA backend and
ptxas); nothing runs.

    plan = launch_plan(...)                       # e.g. ops.splitkv.lowbit.launch_plan
    compile_for(kernel, plan.args, plan.meta)     # {'registers': 168, 'spill_bytes': 0, 'shared_bytes': 39936}

    with captured_launches() as launches:         # or: the launches an op makes, on CPU tensors
        splitkv_attention(q, k, v, ...)           # (nothing runs: its outputs stay uninitialized)
    for kernel, args, meta in launches:
        compile_for(kernel, args, meta)

    main_loop_sass(build(kernel, plan.args, plan.meta))   # (984, {'PRMT': 192, ...}): the main loop's SASS

Gluon kernels (`triton.experimental.gluon`) build the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile

import torch

_PTR = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8", torch.int8: "i8",
        torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")


@contextlib.contextmanager
def captured_launches():
    """Within the block, a Triton kernel launch is recorded as (kernel, args, keyword args) and
    not run; -> the list of them."""
    from triton.runtime.jit import JITFunction

    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, list(args), dict(kwargs)))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def signature(kernel, args: list, meta: dict) -> tuple[dict, dict, dict]:
    """Triton's (signature, constexprs, attrs) for a launch kernel[grid](*args, **meta), specialized
    as a launch on a GPU would be: pointers 16-byte aligned and integers divisible by 16 get
    `tt.divisibility` (what lets the compiler vectorize loads and pipeline them), integers equal
    to 1 become constants. Without it a build is not the one that runs (byte loads, no cp.async)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    names = kernel.arg_names  # a JITFunction's
    sig, const, attrs = {}, {}, {}
    pos = [n for n in names if n not in meta]
    if len(pos) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} positional arguments for {len(pos)} parameters")
    values = dict(zip(pos, args))
    for i, name in enumerate(names):
        if name in meta:
            sig[name], const[name] = "constexpr", meta[name]
            continue
        a = values[name]
        if isinstance(a, torch.Tensor) and a.dtype not in _PTR:
            raise ValueError(f"{name}: no Triton pointer type for {a.dtype}")
        if isinstance(a, float):  # floats are never specialized
            sig[name] = "fp32"
            continue
        if not isinstance(a, (torch.Tensor, bool, int)):
            raise ValueError(f"{name}: cannot type {type(a).__name__}")
        param = kernel.params[i]  # do_not_specialize: no divisibility / == 1 attributes, as at a launch
        kind, attr = native_specialize_impl(BaseBackend, a, False, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        sig[name] = kind
        if kind == "constexpr":
            const[name] = a
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return sig, const, attrs


def build(kernel, args: list, meta: dict, arch: int = 90):
    """The launch kernel[grid](*args, **meta) compiled for sm_`arch` (a Triton or a Gluon kernel):
    Triton's compiled kernel (`.asm['ptx' | 'cubin']`, `.metadata`). Raises what the compiler
    raises for a kernel that does not build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const, attrs = signature(kernel, args, {k: v for k, v in meta.items() if k not in OPTIONS})
    options = {k: meta[k] for k in OPTIONS if k in meta}
    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # an autotuner / heuristics wrapper holds it
        fn = fn.fn
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def compile_for(kernel, args: list, meta: dict, arch: int = 90) -> dict:
    """Compile for sm_`arch`; -> {'registers', 'spill_bytes', 'shared_bytes'} (ptxas -v).
    Raises what the compiler raises for a kernel that does not build."""
    compiled = build(kernel, args, meta, arch)
    return dict(ptxas_report(compiled.asm["ptx"], arch), shared_bytes=int(compiled.metadata.shared))


def main_loop_sass(compiled) -> tuple[int, dict]:
    """(instructions a thread in the build's main loop, {opcode: count}): the loop is the longest
    backward branch of the SASS (the Triton wheel's cuobjdump). Static counts, not timings."""
    import triton
    from collections import Counter

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
    back = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
            and int(m.group(1), 16) < a]
    if not back:
        raise ValueError("the build has no loop")
    lo, hi = max(back, key=lambda x: x[1] - x[0])
    body = [t for a, t in ins if lo <= a <= hi]
    return len(body), dict(Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body))


def ptxas_report(ptx: str, arch: int = 90) -> dict:
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas(arch).path if hasattr(nv, "get_ptxas") else os.path.join(
        os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else 0)
