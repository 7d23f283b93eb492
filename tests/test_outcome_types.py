"""Outcomes are types: in product code no job or shard state is compared as a raw string (JobState and ShardPhase
are StrEnums, shared/messages.py declares them), and no error's kind is read from its text (MeasureResult has an
ErrorKind)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.messages import JobState, ShardPhase

REPO = Path(__file__).resolve().parents[1]
PRODUCT = sorted(str(p.relative_to(REPO)) for pkg in ("services", "shared", "sharetune") for p in (REPO / pkg).rglob("*.py")
                 if p.relative_to(REPO) != Path("shared/messages.py"))
STATES = {s.value for s in JobState} | {s.value for s in ShardPhase}
ERROR_PREFIXES = ("run failed", "build failed", "cancelled", "crash")


def raw_outcomes(source: str) -> list[str]:
    """Comparisons of a value against a state's literal (==, !=, in, not in), and `startswith` of an error's text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            literals = []
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant):
                    literals.append(side.value)
                elif isinstance(side, (ast.Tuple, ast.List, ast.Set)):
                    literals += [e.value for e in side.elts if isinstance(e, ast.Constant)]
            hits = sorted({v for v in literals if isinstance(v, str) and v in STATES})
            if hits:
                found.append(f"line {node.lineno}: compares with {hits}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(a.lower().startswith(ERROR_PREFIXES) for a in args):
                found.append(f"line {node.lineno}: reads an error's kind from its text {args}")
    return found


@pytest.mark.parametrize("module", PRODUCT)
def test_no_state_or_error_kind_is_a_raw_string(module):
    assert raw_outcomes((REPO / module).read_text()) == []


def test_the_scan_sees_a_raw_state_and_an_error_prefix():
    source = 'if job["state"] == "done" or s in ("running", "x"):\n    ok = err.startswith("run failed")\n'
    assert len(raw_outcomes(source)) == 3
    assert raw_outcomes('if state == JobState.DONE:\n    pass\n') == []
