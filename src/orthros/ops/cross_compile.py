"""Compile a Triton kernel launch for an NVIDIA GPU on a machine without one, and read what
ptxas reports (registers, spills, shared memory): a kernel's build for sm_90 can be checked,
and two variants compared, in CI. It needs only the Triton wheel (its NVIDIA backend and
ptxas); nothing runs.

    plan = launch_plan(...)                       # e.g. ops.splitkv_lowbit.launch_plan
    compile_for(kernel, plan.args, plan.meta)     # {'registers': 168, 'spill_bytes': 0, 'shared_bytes': 39936}

    with captured_launches() as launches:         # or: the launches an op makes, on CPU tensors
        splitkv_attention(q, k, v, ...)           # (nothing runs: its outputs stay uninitialized)
    for kernel, args, meta in launches:
        compile_for(kernel, args, meta)
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


def signature(kernel, args: list, meta: dict) -> tuple[dict, dict]:
    """Triton's (signature, constexprs) for a launch kernel[grid](*args, **meta)."""
    names = kernel.arg_names  # a JITFunction's
    sig, const = {}, {}
    pos = [n for n in names if n not in meta]
    if len(pos) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} positional arguments for {len(pos)} parameters")
    for name, a in zip(pos, args):
        if isinstance(a, torch.Tensor):
            if a.dtype not in _PTR:
                raise ValueError(f"{name}: no Triton pointer type for {a.dtype}")
            sig[name] = "*" + _PTR[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise ValueError(f"{name}: cannot type {type(a).__name__}")
    for name in names:
        if name in meta:
            sig[name] = "constexpr"
            const[name] = meta[name]
    return sig, const


def compile_for(kernel, args: list, meta: dict, arch: int = 90) -> dict:
    """Compile for sm_`arch`; -> {'registers', 'spill_bytes', 'shared_bytes'} (ptxas -v).
    Raises what the compiler raises for a kernel that does not build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const = signature(kernel, args, {k: v for k, v in meta.items() if k not in OPTIONS})
    options = {k: meta[k] for k in OPTIONS if k in meta}
    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # an autotuner / heuristics wrapper holds it
        fn = fn.fn
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                              target=GPUTarget("cuda", arch, 32), options=options)
    return dict(ptxas_report(compiled.asm["ptx"], arch), shared_bytes=int(compiled.metadata.shared))


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
