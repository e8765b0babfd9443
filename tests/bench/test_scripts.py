"""The scripts under benchmarks/ that need a GPU to run are at least valid Python that
imports: a broken sweep should fail here, not on the first GPU call of a session."""

import ast
import importlib.util
import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_parses_and_its_imports_resolve(path):
    tree = ast.parse(path.read_text(), filename=str(path))  # a SyntaxError fails the test
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            top = node.names[0].name.split(".")[0]
        else:
            continue
        if top == "orthros":  # the project's own modules must exist as named
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert importlib.util.find_spec(mod) is not None, f"{path.name}: no module {mod}"


def test_dequant_probe_gluon_kernels_build_for_sm90_without_a_barrier():
    """The Gluon probes behind docs/long_context.md's layout design build for sm_90 on this machine
    (no GPU), and their loops hold no barrier, shuffle or shared-memory access: the layouts
    do what the design says, or this fails (e.g. on a Triton whose Gluon converts differently)."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    try:
        import dequant_probe as probe
    finally:
        sys.path.pop(0)
    keys = probe.loop_counts(probe.MODES.index("gluon-lop3"), 64, 4, 16)
    values = probe.value_counts("gluon-values", 4)
    for n, ops in (keys, values):
        assert ops["HMMA"] == 16 and n > 16
        assert not {"BAR", "SHFL", "STS", "LDS", "LDSM"} & set(ops), ops
    (n, ops), _ = probe.tile_counts(4)["gluon-tile"]  # the softmax's reductions stay in the warp (shuffles)
    assert ops["HMMA"] == 32 and not {"BAR", "STS", "LDS", "LDSM"} & set(ops), ops
