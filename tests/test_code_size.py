"""Size limits on product code: no class over 250 lines, no constructor over 8 parameters, no function over
60 lines. Checked on every module of the product (services/, shared/, sharetune/), not on tests, benchmarks or
docs. Values that travel together go in a small frozen dataclass or pydantic model, not in **kwargs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("services", "shared", "sharetune")
MAX_CLASS_LINES, MAX_INIT_PARAMS, MAX_FUNCTION_LINES = 250, 8, 60
CHECKED = sorted(str(p.relative_to(REPO)) for package in PRODUCT for p in (REPO / package).rglob("*.py"))


def oversized(source: str) -> list[str]:
    """What in `source` breaks a limit, one line each (empty: nothing)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            if lines > MAX_CLASS_LINES:
                found.append(f"class {node.name}: {lines} lines")
            continue
        if lines > MAX_FUNCTION_LINES:
            found.append(f"function {node.name}: {lines} lines")
        if node.name == "__init__":
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg) - 1
            if params > MAX_INIT_PARAMS:
                found.append(f"constructor at line {node.lineno}: {params} parameters")
    return found


@pytest.mark.parametrize("module", CHECKED)
def test_classes_constructors_and_functions_stay_small(module):
    assert oversized((REPO / module).read_text()) == []


def test_every_product_module_is_checked():
    assert len(CHECKED) > 50
    assert {"services/tuner/search.py", "shared/settings.py", "sharetune/cli.py"} <= set(CHECKED)


def test_the_check_sees_an_oversized_class_and_constructor():
    params = ", ".join(f"p{i}" for i in range(MAX_INIT_PARAMS + 1))
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    source = f"class Big:\n    def __init__(self, {params}):\n        pass\n{body}\n"
    assert [f.split(":")[0] for f in oversized(source)] == ["class Big", "constructor at line 2"]
