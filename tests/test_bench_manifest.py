"""Every results file under bench/results is in its manifest (bench/results/MANIFEST.json) with the script,
host, command, commit and date that made it, and every manifest entry still exists; a retired script is found
at the commit its entries name."""
import json

from bench import manifest


def test_every_results_file_is_in_the_manifest_with_its_provenance():
    entries = json.loads(manifest.MANIFEST.read_text())
    assert manifest.check(entries) == []
    for name, entry in entries.items():
        assert manifest.script_missing(entry) is None, name


def test_the_check_names_a_results_file_the_manifest_misses():
    entries = json.loads(manifest.MANIFEST.read_text())
    missing = sorted(entries)[0]
    assert f"not in the manifest: {missing}" in manifest.check({k: v for k, v in entries.items() if k != missing})
    assert f"{missing}: no command" in manifest.check({**entries, missing: {**entries[missing], "command": None}})


def test_the_check_names_a_script_that_is_gone_without_a_retired_commit():
    entries = json.loads(manifest.MANIFEST.read_text())
    retired = next(n for n, e in entries.items() if e.get("retired"))
    unmarked = {k: v for k, v in entries[retired].items() if k != "retired"}
    assert any(p.startswith(f"{retired}: ") and "not marked retired" in p
               for p in manifest.check({**entries, retired: unmarked}))
    wrong = {**entries[retired], "retired": manifest._git("rev-list", "--max-parents=0", "HEAD").split()[0]}
    assert any(p.startswith(f"{retired}: ") and "retired commit" in p for p in manifest.check({**entries, retired: wrong}))


def test_a_results_file_records_its_command_code_host_and_date(tmp_path, monkeypatch):
    from bench.harness.common import results_path, write_results

    monkeypatch.setenv("OUT", str(tmp_path))
    path = write_results({"rows": [1]}, results_path("x.json"), "bench.x", ["--trials", "8"])
    body = json.loads(path.read_text())
    assert path == tmp_path / "x.json" and body["rows"] == [1]
    assert body["command"] == "python -m bench.x --trials 8" and body["date"] and body["host"]["cores"]
    assert len(body["git"]["commit"]) == 40
    assert manifest.as_run_now(body["command"]) == body["command"]
