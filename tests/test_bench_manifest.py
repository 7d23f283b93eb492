"""Every results file under bench/results is in its manifest (bench/results/MANIFEST.json) with the script,
host, command, commit and date that made it, and every manifest entry still exists."""
import json

from bench import manifest
from bench.harness.common import REPO


def test_every_results_file_is_in_the_manifest_with_its_provenance():
    entries = json.loads(manifest.MANIFEST.read_text())
    assert manifest.check(entries) == []
    for name, entry in entries.items():
        assert (REPO / entry["script"]).exists(), name


def test_the_check_names_a_results_file_the_manifest_misses():
    entries = json.loads(manifest.MANIFEST.read_text())
    missing = sorted(entries)[0]
    assert f"not in the manifest: {missing}" in manifest.check({k: v for k, v in entries.items() if k != missing})
    assert f"{missing}: no command" in manifest.check({**entries, missing: {**entries[missing], "command": None}})
