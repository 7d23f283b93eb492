"""Every results file under bench/results is in its manifest (bench/results/MANIFEST.json: script, host,
commit, date, command, the docs citing it), and every manifest entry still exists."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import manifest  # noqa: E402


def test_every_results_file_is_in_the_manifest():
    entries = json.loads(manifest.MANIFEST.read_text())
    assert manifest.check(entries) == []
    for name, entry in entries.items():
        assert entry.get("commit") and entry.get("date") and entry.get("host"), name
        assert entry.get("script") is None or (ROOT / entry["script"]).exists(), name
