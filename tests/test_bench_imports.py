"""bench/ is a package run as `python -m bench.<name>`: no script edits sys.path, and none imports from tests/
(code that benchmarks and tests share lives in the testing kit, sharetune/testing); and bench/ (its .py and .sh
files, results excluded) stays within MAX_BENCH_LINES."""
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.(insert|append|extend)\b|\[|\+=|=)")
TESTS_IMPORT = re.compile(r"^\s*(from|import)\s+(tests\b|faultlib\b|fakes\b|conftest\b)", re.MULTILINE)


def scripts():
    return sorted(BENCH.rglob("*.py"))


def test_no_bench_module_edits_sys_path():
    assert [str(p.relative_to(BENCH)) for p in scripts() if SYS_PATH_EDIT.search(p.read_text())] == []


def test_no_bench_module_imports_from_tests():
    assert [str(p.relative_to(BENCH)) for p in scripts() if TESTS_IMPORT.search(p.read_text())] == []



MAX_BENCH_LINES = 2500  # bench/ stays small: analysis goes to sharetune/experiments, finished experiments retire


def test_bench_stays_within_its_line_budget():
    files = [p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.relative_to(BENCH).parts]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert lines <= MAX_BENCH_LINES, f"bench/ has {lines} lines of .py and .sh (results excluded), over {MAX_BENCH_LINES}"
