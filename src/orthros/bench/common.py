"""What the benchmarks share: random-weight models, timing, memory, the run's environment, output files."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import time

import torch

from ..errors import is_oom  # noqa: F401 - imported from here by the benches
from ..models import OrthrosConfig
from ..random_model import build_model, made_on  # noqa: F401 - build_model: imported from here by the benchmarks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def environment(device: torch.device) -> dict:
    """Date, GPU, library versions: printed with every table."""
    import transformers

    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version())
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = "none (CPU: " + (platform.processor() or platform.machine()) + ")"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def variant_config(args, variant: str, positions: int) -> OrthrosConfig:
    """The preset `args.model` as `variant` (window `args.window`, `args.layers` if set), long enough for `positions`.
    `orthros-bound` / `orthros-base`: Orthros with a mixture of experts' output rows routed that way."""
    attention, _, routing = variant.partition("-")
    over = dict(window_size=args.window, attention=attention, **({"output_routing": routing} if routing else {}))
    if args.layers:
        over["num_hidden_layers"] = args.layers
    cfg = OrthrosConfig.from_name(args.model, **over)
    if routing and not cfg.num_experts:
        raise ValueError(f"variant {variant!r} routes experts: {args.model} has none (a MoE shape: tiny-moe, "
                         "qwen3-30b-a3b)")
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, positions)
    return cfg


def build_hf_peer(config: OrthrosConfig, device, dtype):
    """transformers' own Llama / Qwen3 model at the same shapes, SDPA attention."""
    import transformers

    c = config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                  max_position_embeddings=max(c.max_position_embeddings, 1 << 21),
                  tie_word_embeddings=c.tie_word_embeddings)
    if c.qk_norm:
        hc = transformers.Qwen3Config(**common, rope_theta=c.rope_theta)
        cls = transformers.Qwen3ForCausalLM
    else:
        hc = transformers.LlamaConfig(**common, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
        cls = transformers.LlamaForCausalLM
    hc._attn_implementation = "sdpa"
    return made_on(device, dtype, cls, hc)


@contextlib.contextmanager
def truncated(model, n_layers: int):
    """Temporarily keep only the first `n_layers` blocks (cheap warm-up at the real shapes)."""
    inner = model.model
    layers = inner.layers
    inner.layers = layers[:n_layers]
    try:
        yield model
    finally:
        inner.layers = layers


@contextlib.contextmanager
def attention_removed():
    """The linear floor: every attention op returns its queries (same shape, no work)."""
    import orthros.layers.attention as layer

    real = layer.attend
    layer.attend = lambda q, *args, **kwargs: q
    try:
        yield
    finally:
        layer.attend = real


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device) -> float:
    """time.perf_counter() once the device's queued work is done."""
    sync(device)
    return time.perf_counter()


def copy_bandwidth(device, nbytes: int | None = None, repeats: int = 5) -> float:
    """The device's copy bandwidth in TB/s: bytes read and written a second by the best of `repeats`
    copies of `nbytes` (default 1 GiB on a GPU, 64 MiB on a CPU). The decode benches' roofline when no
    --bandwidth is given, so a figure is a share of what this machine moves, whatever the card."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = now(device)
        b.copy_(a)
        best = min(best, now(device) - t0)
    del a, b
    return 2 * nbytes / best / 1e12


def timed(fn, device):
    """(seconds, peak GiB allocated during the call (weights included), result) of one call."""
    free_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return dt, peak, out


KERNEL_GROUPS = [  # (group, substrings of kernel names), first match wins
    ("split-KV attention", ("splitkv", "paged_fwd", "lowbit_packed", "lowbit_finish")),
    ("FlexAttention (SWA)", ("flex", "triton_tem")),
    ("SDPA attention", ("fmha", "flash", "cudnn", "attention")),
    ("fused MoE experts", ("moe_up", "moe_down")),
    ("GEMM (linear layers)", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90")),
    ("fused elementwise (norms, RoPE, SwiGLU gate)",
     ("triton_poi", "triton_red", "triton_per", "rms_norm_fwd", "heads_fwd", "silu_mul_fwd")),
    ("copies / cat", ("copy", "cat", "memcpy", "memset")),
]
OTHER_KERNELS = "other (norms, RoPE, elementwise)"


def kernel_profile(fn, device, top: int = 15) -> dict:
    """Device time of `fn()` by kernel group and its `top` kernels, in ms (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    return kernel_groups(prof.key_averages(), top)


def kernel_groups(events, top: int = 15) -> dict:
    """A profile's device kernels (`prof.key_averages()`) by group and its `top` kernels, in ms."""
    groups: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for ev in events:
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if not t or ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        key = ev.key.lower()
        g = next((g for g, subs in KERNEL_GROUPS if any(s in key for s in subs)), OTHER_KERNELS)
        groups[g] = groups.get(g, 0.0) + t / 1e3
        kernels[ev.key[:90]] = kernels.get(ev.key[:90], 0.0) + t / 1e3
    return {"groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top]),
            "kernel_count": sum(ev.count for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA)}


def subplots(n: int, width: float, height: float):
    """A row of `n` matplotlib axes (Agg backend): (figure, [axes])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def log_panel(ax, xlabel: str, ylabel: str, title: str, log_y: bool = False):
    """Log2 length axis (log y if asked), labels, grid and legend: every length plot's frame."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress(msg: str) -> None:
    """A timestamped line on stderr: a run cut by a time limit says where it was."""
    print(time.strftime("%H:%M:%S ") + msg, file=sys.stderr, flush=True)


def partial_path(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, f"{name}.partial.json")


def save_partial(out_dir: str, name: str, result: dict) -> None:
    """The rows so far, as `partial_path` (a row can take minutes: a run stopped part-way keeps
    what it measured; `--from-json` renders it). Replaced atomically; `result_from` removes it
    once the whole run is saved."""
    os.makedirs(out_dir, exist_ok=True)
    path = partial_path(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def result_from(args, name: str, measure, key=None) -> dict:
    """`--from-json FILE [FILE ...]` re-renders saved runs (several: their rows in one table, e.g.
    one run per model shape, saved merged as `OUT_DIR/name.json`); otherwise `measure()` runs and
    `OUT_DIR/name.json` is written. key(row): rows of several runs with the same key are one
    measurement repeated, and the later run's row replaces the earlier one."""
    if args.from_json:
        paths = [args.from_json] if isinstance(args.from_json, str) else list(args.from_json)
        runs = [read_result(path, args.bench) for path in paths]
        if len(runs) == 1:
            return runs[0]
        result = merge_runs(runs)  # saved as one run (the inputs are read already)
        if key is not None:
            result["rows"] = list({key(r): r for r in result["rows"]}.values())
    else:
        result = measure()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not args.from_json:  # the whole run is saved: the rows a cut run would have kept go
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial_path(args.out_dir, name))
    return result


def read_result(path: str, bench: str) -> dict:
    """A saved `orthros bench BENCH` result (`--from-json`); UserError naming the file otherwise."""
    from ..errors import UserError, read_json

    if not os.path.exists(path):
        raise FileNotFoundError(f"--from-json: no such file {path}")
    r = read_json(path, "benchmark result")
    if not (isinstance(r, dict) and isinstance(r.get("rows"), list) and isinstance(r.get("env"), dict)
            and all(isinstance(row, dict) for row in r["rows"])):
        raise UserError(f"{path}: not a saved `orthros bench {bench}` result (no rows / env)")
    cmd = str(r.get("command", ""))
    if cmd.startswith("orthros bench ") and not cmd.startswith(f"orthros bench {bench}"):
        raise UserError(f"{path}: a result of `{' '.join(cmd.split()[:3])}`, not of `orthros bench {bench}`")
    return r


def merge_runs(runs: list[dict]) -> dict:
    """Saved runs of one benchmark as one: rows concatenated, commands and dates joined,
    other fields from the first run that has them."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    for r in runs[1:]:
        for k, v in r.items():
            if merged.get(k) is None:
                merged[k] = v
    merged["rows"] = [row for r in runs for row in r.get("rows", [])]
    merged["command"] = "` and `".join(r["command"] for r in runs if r.get("command"))
    env = dict(merged["env"])
    env["date"] = " / ".join(dict.fromkeys(r["env"]["date"] for r in runs))
    merged["env"] = env
    return merged


def add_run_arguments(p, compile: bool = False, bandwidth: bool = False) -> None:
    """The model and device flags the benches share: --layers, --dtype, --device (and --no-compile, --bandwidth)."""
    from ..errors import count_arg, positive_arg

    if compile:
        p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly")
    if bandwidth:
        p.add_argument("--bandwidth", type=positive_arg, default=None,
                       help="copy bandwidth ceiling in TB/s (default: measured on the device: a copy's bytes read "
                            "and written a second)")
    p.add_argument("--layers", type=count_arg(1), default=None, help="override the layer count (smoke runs)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default=None, help="default: cuda if available")


def add_docs_argument(p, page: str) -> None:
    """`--docs PAGE`: also splice the table into a docs page (`page`: the one that shows it)."""
    p.add_argument("--docs", default=None, metavar="PAGE",
                   help=f"also splice the table into PAGE between its markers (e.g. {page}); by default a run "
                        f"writes only under --out-dir (until 2026-12-04 the default was {page})")


def render(result, out_dir, docs, name, table_fn, plot_fn) -> None:
    """Write `name.md` and `name.png`, print the table, splice it into `docs` between `name`'s markers."""
    os.makedirs(out_dir, exist_ok=True)
    text = table_fn(result)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    plot_fn(result, os.path.join(out_dir, f"{name}.png"))
    print(text)
    if splice_marks(docs, text, (f"<!-- {name}-table:begin -->", f"<!-- {name}-table:end -->")):
        print(f"table written into {docs}")


def splice_marks(doc_path, text, marks) -> bool:
    """Replace the text between `marks` in `doc_path` (if the file and both marks exist)."""
    if not doc_path or not os.path.exists(doc_path):
        return False
    with open(doc_path) as f:
        doc = f.read()
    begin, end = marks
    if begin not in doc or end not in doc:
        return False
    a, b = doc.index(begin) + len(begin), doc.index(end)
    with open(doc_path, "w") as f:
        f.write(doc[:a] + "\n" + text + "\n" + doc[b:])
    return True
