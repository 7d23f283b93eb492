"""Progress bars and ETAs: pure functions of a status dict and a clock (no stack needed)."""
from sharetune.progress import bar, estimates, fmt_s, fmt_us, render


def _status(state="tuning", trials=(6, 4), best=(123.4, None), budget=20):
    return {"job_id": "j1", "name": "tiny", "target": "llvm", "share": 50, "state": state, "error": None,
            "budget": budget, "trials": sum(trials), "times": {"tuning_at": 1000.0},
            "tasks": [{"task": f"t{i}", "weight": i + 1, "trials": n, "errors": 0, "best_us": b, "reused_trials": 0}
                      for i, (n, b) in enumerate(zip(trials, best))]}


def test_eta_from_the_trial_rate():
    est = estimates(_status(), now=1010.0)  # 10 trials in 10 s, 10 left
    assert est["rate"] == 1.0 and est["eta_s"] == 10.0 and est["fraction"] == 0.5
    assert [t["fraction"] for t in est["tasks"]] == [0.6, 0.4]  # against an even split of 20 over 2 tasks
    assert est["tasks"][0]["eta_s"] == (10 - 6) / 0.6


def test_no_eta_before_the_first_trial_and_zero_when_done():
    assert estimates(_status(trials=(0, 0), best=(None, None)), now=1010.0)["eta_s"] is None
    assert estimates(_status(state="done", trials=(5, 5)), now=1010.0)["eta_s"] == 0.0
    assert estimates({**_status(state="queued"), "times": {}}, now=5.0)["elapsed_s"] is None


def test_render_shows_every_task_with_best_latency():
    lines = render(_status(), now=1010.0)
    assert lines[0].startswith("job j1 (tiny, llvm at 50 %): tuning")
    assert "10/20 trials" in lines[1] and "ETA 10s" in lines[1]
    assert len(lines) == 4 and "123.4 us" in lines[2] and "best          -" in lines[3]
    # the model estimate needs every task's best, or its default schedule's time where that is known
    assert "x weight -" in lines[1]
    assert "x weight 1.12 ms" in render(_status(best=(100.0, 510.0)), now=1010.0)[1]
    st = _status()
    st["tasks"][1]["default_us"] = 200.0  # no trial yet: the default schedule runs
    st["tasks"][0]["default_us"] = 50.0  # faster than the best found: the default is kept
    assert "x weight 450.0 us" in render(st, now=1010.0)[1]


def test_formatting():
    assert bar(0.5, 4) == "[##..]" and bar(2, 2) == "[##]"
    assert fmt_us(1500) == "1.50 ms" and fmt_us(None) == "-"
    assert fmt_s(59) == "59s" and fmt_s(61) == "1m01s" and fmt_s(3700) == "1h01m" and fmt_s(None) == "-"


def test_the_terminal_view_shows_what_the_lines_show():
    from rich.console import Console

    from sharetune.progress import live_view

    console = Console(width=140, record=True, color_system=None)
    console.print(live_view(_status(best=(100.0, 510.0)), now=1010.0))
    text = console.export_text()
    assert text.splitlines()[0] == "job j1 (tiny, llvm at 50 %): tuning"
    assert "10/20 trials" in text and "ETA 10s" in text and "x weight 1.12 ms" in text
    assert "t0" in text and "t1" in text and "100.0 us" in text and "510.0 us" in text


def test_a_job_stopped_early_says_why_in_both_views():
    from rich.console import Console

    from sharetune.progress import live_view

    st = {**_status(state="done", trials=(5, 5)), "stopped": "time limit: 60 s of tuning passed"}
    assert render(st, now=1010.0)[0].endswith("done - stopped early: time limit: 60 s of tuning passed")
    console = Console(width=140, record=True, color_system=None)
    console.print(live_view(st, now=1010.0))
    assert "stopped early: time limit: 60 s" in console.export_text().splitlines()[0]
    assert "stopped early" not in render(_status(), now=1010.0)[0]


def test_a_job_with_stopping_rules_shows_where_it_stands_against_them():
    from sharetune.progress import stopping_line

    st = {**_status(), "stopping": {"time_limit_s": 60.0, "patience": 32, "min_gain_pct": 1.0, "mark_trials": None}}
    line = stopping_line(st, now=1010.0)
    assert line == "stops at: time limit 60 s (50s left); patience 32: counts once every task has had a round"
    st["stopping"]["mark_trials"] = 4
    assert stopping_line(st, now=1010.0).endswith("patience 32: 6 trials since the estimate last fell 1 %")
    assert any(line.strip().startswith("stops at:") for line in render(st, now=1010.0))
    assert stopping_line(_status(), now=1010.0) is None  # no rules
    assert stopping_line({**st, "state": "done"}, now=1010.0) is None
    assert stopping_line({**st, "stopped": "patience: ..."}, now=1010.0) is None  # the header says why
