"""bench/ is a package run as `python -m bench.<name>`: no script edits sys.path, and none imports from tests/
(code that benchmarks and tests share lives in the testing kit, sharetune/testing)."""
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
# still run as `python bench/<name>.py` while they are measured elsewhere; to be ported to the harness
NOT_PORTED_YET = {"time_to_quality.py"}
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.(insert|append|extend)\b|\[|\+=|=)")
TESTS_IMPORT = re.compile(r"^\s*(from|import)\s+(tests\b|faultlib\b|fakes\b|conftest\b)", re.MULTILINE)


def scripts():
    return sorted(p for p in BENCH.rglob("*.py") if p.name not in NOT_PORTED_YET)


def test_no_bench_module_edits_sys_path():
    assert [str(p.relative_to(BENCH)) for p in scripts() if SYS_PATH_EDIT.search(p.read_text())] == []


def test_no_bench_module_imports_from_tests():
    assert [str(p.relative_to(BENCH)) for p in scripts() if TESTS_IMPORT.search(p.read_text())] == []


def test_the_exempt_scripts_still_exist():
    # the exemption is for these by name: once ported, they drop out of NOT_PORTED_YET
    assert all((BENCH / name).exists() for name in NOT_PORTED_YET)
