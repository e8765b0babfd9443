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
