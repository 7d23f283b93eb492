"""The results manifest, bench/results/MANIFEST.json: for each results file (or kept folder) under
bench/results, the script that wrote it, the host it ran on, the commit and date it was last committed at, the
command that reproduces it (the one the results file records, else the one the docs give; set by hand where
neither does, and then kept), and the docs that cite it. A file no doc cites is listed with `"cited_by": []`:
raw data kept beside the figures made from it. A file whose script was retired keeps its entry, with
`"retired": "<commit>"`: a commit that still has the script (`git show <commit>:bench/<script>.py`).

    python -m bench.manifest            # refresh commits, dates and citations; add new files (commands kept)
    python -m bench.manifest --check    # exit 1 when a results file is missing from the manifest, or the reverse,
                                        # or an entry's script is neither here nor at its `retired` commit

tests/test_bench_manifest.py runs the check."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.harness.common import REPO, RESULTS, git

MANIFEST = RESULTS / "MANIFEST.json"
FIELDS = ("script", "host", "command", "commit", "date")


def results_entries() -> list[str]:
    """Every results file and kept folder (a folder counts once), relative to bench/results."""
    return sorted(p.name for p in RESULTS.iterdir() if p.name != MANIFEST.name)


def _git(*args: str) -> str:
    return git(*args).strip()


def _docs() -> dict[str, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "deploy").rglob("*.md"))]
    return {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in paths}


def _script_for(name: str) -> str | None:
    """The bench script whose source names the file (its default output), else the one whose name it starts with."""
    stem = name.split(".")[0]
    scripts = sorted((REPO / "bench").glob("*.py"))
    for s in scripts:
        if name in s.read_text(errors="replace"):
            return f"bench/{s.name}"
    best = max((s for s in scripts if stem.startswith(s.stem)), key=lambda s: len(s.stem), default=None)
    return f"bench/{best.name}" if best else None


def _command_in(docs: dict[str, str], script: str | None) -> str | None:
    if not script:
        return None
    module = "bench." + Path(script).stem
    for text in docs.values():
        m = re.search(rf"python3? (?:-m {re.escape(module)}\b|{re.escape(script)})[^`\n]*", text)
        if m:
            return m.group(0).strip()
    return None


def _recorded_command(name: str) -> str | None:
    """The command a results file records itself, as it is run now."""
    try:
        body = json.loads((RESULTS / name).read_text()) if name.endswith(".json") else {}
    except (OSError, ValueError):
        return None
    command = body.get("command") if isinstance(body, dict) else None
    return as_run_now(command) if isinstance(command, str) else None


def as_run_now(command: str) -> str:
    """`python bench/x.py ...` as `python -m bench.x ...`: every script runs as a module."""
    return re.sub(r"python(3?) bench/(\w+)\.py", r"python\1 -m bench.\2", command)


def refresh(old: dict) -> dict:
    docs, out = _docs(), {}
    for name in results_entries():
        entry = dict(old.get(name) or {})
        entry.setdefault("script", _script_for(name))
        entry.setdefault("host", "one NVIDIA H200 + 16 cores" if "h200" in name or name.startswith("time_to_quality")
                         else "this project's 2-core CPU host")
        entry["command"] = as_run_now(_recorded_command(name) or entry.get("command")
                                      or _command_in(docs, entry["script"]) or "")
        log = _git("log", "-1", "--format=%h %cs", "--", f"bench/results/{name}").split()
        if log:
            entry["commit"], entry["date"] = log
        entry["cited_by"] = sorted(doc for doc, text in docs.items() if name in text)
        out[name] = entry
    return out


def script_missing(entry: dict) -> str | None:
    """Why an entry's script cannot be found (None when it can): here, or at its `retired` commit (checked
    where git can tell)."""
    script = entry.get("script")
    if not script or (REPO / script).exists() and not entry.get("retired"):
        return None
    if not entry.get("retired"):
        return f"{script} is gone and the entry is not marked retired"
    if _git("rev-parse", "--git-dir") and _git("cat-file", "-t", f"{entry['retired']}:{script}") != "blob":
        return f"{script} is not at its retired commit {entry['retired']}"
    return None


def check(manifest: dict) -> list[str]:
    """What is wrong with the manifest: results files it misses, entries whose file is gone, fields left empty,
    scripts that are neither here nor at their retired commit."""
    have = set(results_entries())
    return ([f"not in the manifest: {n}" for n in sorted(have - set(manifest))]
            + [f"in the manifest but gone: {n}" for n in sorted(set(manifest) - have)]
            + [f"{n}: no {f}" for n, e in sorted(manifest.items()) for f in FIELDS if not e.get(f)]
            + [f"{n}: {why}" for n, e in sorted(manifest.items()) if (why := script_missing(e))])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    if args.check:
        problems = check(manifest)
        print("\n".join(problems) or "every results file is in the manifest")
        return 1 if problems else 0
    MANIFEST.write_text(json.dumps(refresh(manifest), indent=1) + "\n")
    print(f"{MANIFEST.relative_to(REPO)}: {len(results_entries())} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
