"""Configuration enters a process in one place: shared/settings.py. No other product module (services/, shared/,
sharetune/) reads a SHARETUNE_* variable from the environment, no module builds a settings object as it is
imported, and nothing in shared/ builds one at all: each process's entry point builds its settings once and
passes them down (setting a variable for a child process is fine: the child reads it through its own)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = "shared/settings.py"
PRODUCT = sorted(str(p.relative_to(REPO)) for package in ("services", "shared", "sharetune")
                 for p in (REPO / package).rglob("*.py"))


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a string (JOIN_ENV = "SHARETUNE_JOIN_URL")."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def sharetune_env_reads(source: str) -> list[str]:
    """Where `source` reads a SHARETUNE_* variable from the environment: os.getenv, os.environ.get / setdefault /
    [...] / `in`, and a pop whose value is used; one line each."""
    tree = ast.parse(source)
    names = _constants(tree)

    def sharetune(node) -> bool:
        value = node.value if isinstance(node, ast.Constant) else names.get(node.id) if isinstance(node, ast.Name) else None
        return isinstance(value, str) and value.startswith("SHARETUNE_")

    discarded = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # a call as a statement
    found = []
    for node in ast.walk(tree):
        read = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if f.attr == "getenv" or (_is_environ(f.value) and f.attr in ("get", "setdefault")) or (
                    _is_environ(f.value) and f.attr == "pop" and id(node) not in discarded):
                read = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            read = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                _is_environ(c) for c in node.comparators):
            read = node.left
        if read is not None and sharetune(read):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _builds_settings(node: ast.AST) -> bool:
    """A call to a class whose name ends in Settings (LaneSettings(), settings.TunerSettings(), X.model_construct())."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in ("model_construct", "model_validate"):
        f = f.value
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name.endswith("Settings")


def built_at_import(source: str) -> list[str]:
    """Settings objects `source` builds as it is imported: in a module-level (or class-level) statement, a
    default argument or a decorator, never inside a function body."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for part in [*node.decorator_list, *node.args.defaults, *filter(None, node.args.kw_defaults)]:
                visit(part)
            return
        if isinstance(node, ast.Lambda):
            return
        if _builds_settings(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def built_anywhere(source: str) -> list[str]:
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(source)) if _builds_settings(n)]


@pytest.mark.parametrize("module", [m for m in PRODUCT if m != SETTINGS])
def test_no_module_but_the_settings_reads_a_sharetune_variable(module):
    assert sharetune_env_reads((REPO / module).read_text()) == []


@pytest.mark.parametrize("module", PRODUCT)
def test_no_module_builds_settings_as_it_is_imported(module):
    assert built_at_import((REPO / module).read_text()) == []


@pytest.mark.parametrize("module", [m for m in PRODUCT if m.startswith("shared/") and m != SETTINGS])
def test_shared_builds_no_settings(module):
    assert built_anywhere((REPO / module).read_text()) == []


def test_the_scans_see_what_they_look_for():
    reads = '''
import os
from os import environ
KEY = "SHARETUNE_JOIN_URL"
a = os.environ.get("SHARETUNE_LANE")
b = os.getenv("SHARETUNE_NODE", "local")
c = os.environ["SHARETUNE_WORK_DIR"]
d = "SHARETUNE_SEARCH_THREADS" in os.environ
e = environ.get(KEY)
f = os.environ.pop(KEY, None)
os.environ.pop(KEY, None)
os.environ["SHARETUNE_LANE"] = "measure.cpu.c0"
g = os.environ.get("REDIS_URL")
'''
    assert [r.split(":")[0] for r in sharetune_env_reads(reads)] == [f"line {n}" for n in (5, 6, 7, 8, 9, 10)]
    imported = '''
from shared.settings import LaneSettings, TunerSettings
from shared import settings
settings_now = LaneSettings()
app = make(settings.TunerSettings().redis_url)
defaults = TunerSettings.model_construct()

class Worker:
    conf = LaneSettings()

    def configure(self, s=LaneSettings()):
        self.settings = TunerSettings()

def main():
    return LaneSettings()
'''
    assert [r.split(":")[0] for r in built_at_import(imported)] == [f"line {n}" for n in (4, 5, 6, 9, 11)]
    assert len(built_anywhere(imported)) == 7


def test_settings_parse_what_the_environment_gives(monkeypatch):
    from pydantic import ValidationError

    from shared.settings import BrokerSettings, CliSettings, LaneSettings, StackSettings

    monkeypatch.setenv("SHARETUNE_CUDA_COMPILE", " TVM ")
    monkeypatch.setenv("SHARETUNE_BUILDER_HIDE_GPUS", "0")
    monkeypatch.setenv("SHARETUNE_NODE", "big")
    s = LaneSettings()
    assert (s.cuda_compile, s.builder_hide_gpus, s.host().node) == ("tvm", False, "big")
    monkeypatch.setenv("SHARETUNE_CUDA_COMPILE", "fast")
    with pytest.raises(ValidationError, match="cuda_compile"):
        LaneSettings()
    monkeypatch.setenv("SHARETUNE_REDIS_MAXMEMORY", "2gb")
    assert BrokerSettings().redis_maxmemory == StackSettings().redis_maxmemory == "2gb"
    assert StackSettings().given("search_threads") is None  # the stack then splits the host's cores
    monkeypatch.setenv("SHARETUNE_SEARCH_THREADS", "0")
    assert StackSettings().given("search_threads") == 0  # given, even as 0: the clients' own
    monkeypatch.delenv("SHARETUNE_WORK_DIR", raising=False)
    assert str(CliSettings().work_dir) == "runs/stack" and str(StackSettings().work_dir) == "runs"
