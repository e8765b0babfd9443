"""GGUF input: damaged, truncated, foreign and unsupported files are one clear error.

The real file (SmolLM2's) is converted in tests/convert/test_smollm2.py; here the
header checks run on small files written with the `gguf` package itself.
"""

import numpy as np
import pytest

from orthros import cli
from orthros.convert.gguf import find_gguf, is_gguf, read_gguf_info


def write_gguf(path, arch="llama", n=64):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((n, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_of_a_small_file_is_read(tmp_path):
    info = read_gguf_info(write_gguf(tmp_path / "m.gguf"))
    assert info.architecture == "llama" and info.tensors == 1
    assert is_gguf(tmp_path / "m.gguf") and is_gguf(tmp_path) and find_gguf(tmp_path) == tmp_path / "m.gguf"


@pytest.mark.parametrize("case", ["truncated", "not-gguf", "empty", "unsupported", "none-in-dir", "several"])
def test_bad_gguf_inputs_are_one_line_errors(tmp_path, capsys, case):
    src = tmp_path / "in"
    src.mkdir()
    if case == "truncated":
        data = write_gguf(tmp_path / "full.gguf", n=4096).read_bytes()
        (src / "m.gguf").write_bytes(data[: len(data) - 10_000])
        want = "truncated GGUF file"
    elif case == "not-gguf":
        (src / "m.gguf").write_bytes(b"PK\x03\x04" + b"\x00" * 100)
        want = "not a GGUF file"
    elif case == "empty":
        (src / "m.gguf").write_bytes(b"")
        want = "not a GGUF file"
    elif case == "unsupported":
        write_gguf(src / "m.gguf", arch="gemma2")
        want = "unsupported GGUF architecture 'gemma2'"
    elif case == "none-in-dir":
        (src / "notes.txt").write_text("hi")
        want = "no config.json"
    else:
        write_gguf(src / "a.gguf")
        write_gguf(src / "b.gguf")
        want = "several .gguf files"
    arg = src if case in ("none-in-dir", "several") else src / "m.gguf"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert cli.main(["convert", str(arg), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing left behind
