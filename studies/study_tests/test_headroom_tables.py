"""The headroom study's verdict and figures (studies/headroom_tables.py), by hand: the plan's
rule, the headroom check, the constraint bins over a window, and their plot."""

from __future__ import annotations

import pytest

from .helpers import load

tables = load("headroom_tables")
stats = load("study_stats")
regime = load("paper_regime_tables")

ACC, ZERO = "val/accuracy", "reward/frac_zero_std"


def record(objective: str, seed: int, late: float, zero: float = 0.5, **extra) -> dict:
    """A run of 80 rollouts: held-out accuracy 0.3 at 10-50 and ``late`` at 60-80; ``zero``
    groups without spread at every rollout; ``extra`` figures at every rollout."""
    history = [{"rollout": 0, ACC: 0.25}]
    for r in range(1, 81):
        row = {"rollout": r, ZERO: zero, **extra}
        if r % 10 == 0:
            row[ACC] = late if r >= 60 else 0.3
        history.append(row)
    fields = {"objective": objective, "lr": 1e-5, "seed": seed}
    return {"name": f"{objective}-s{seed}", "fields": fields, "history": history}


def grid(troll: list[float], clip: list[float]) -> list[dict]:
    return [record("troll", s, t) for s, t in enumerate(troll)] + [
        record("clip", s, c) for s, c in enumerate(clip)
    ]


ARMS = ("troll lr 1e-05", "clip lr 1e-05")


@pytest.mark.parametrize(
    ("troll", "expected"),
    [
        ([0.52, 0.53, 0.51, 0.54, 0.50], "TROLL ahead"),
        ([0.46, 0.45, 0.47, 0.44, 0.48], "clipping ahead"),
        ([0.52, 0.48, 0.53, 0.47, 0.50], "no difference shown"),
        ([0.60, 0.60, 0.60, 0.60], "no verdict: the rule is for 5 paired seeds, and 4 are in"),
    ],
)
def test_the_verdict_follows_the_plans_rule(troll, expected):
    """Against clipping at 0.49 on every seed: four or five seeds of one sign with p < 0.05 make
    an arm ahead; a split is no difference, with its mean and spread; fewer than 5 seeds, none."""
    result, seeds = tables.late_pairs(grid(troll, [0.49] * len(troll)), *ARMS)
    assert seeds == list(range(len(troll)))
    assert result.diffs == pytest.approx([t - 0.49 for t in troll])
    assert tables.verdict(result).startswith(expected)


def test_runs_that_never_reach_the_late_window_have_no_verdict():
    """Runs of 50 rollouts share no validation in rollouts 60-80: no paired result, no verdict,
    and the headroom check says the window was not reached."""
    records = grid([0.5] * 5, [0.4] * 5)
    for r in records:
        r["history"] = [row for row in r["history"] if row["rollout"] <= 50]
    result, seeds = tables.late_pairs(records, *ARMS)
    assert result is None and seeds == [0, 1, 2, 3, 4]
    assert tables.verdict(result) == "no verdict: the runs share no validation in rollouts 60-80"
    assert "| nan | not reached |" in tables.headroom_check(records, *ARMS)


def test_one_seed_against_the_rest_is_no_difference_even_with_a_large_mean():
    """Four seeds at +0.001 and one at +0.30: the mean is large but the t-test's p is not below
    0.05, so the rule gives no difference."""
    result = stats.paired([0.501, 0.501, 0.501, 0.501, 0.80], [0.5] * 5)
    assert result.p_t > 0.05
    assert tables.verdict(result).startswith("no difference shown: mean +0.061")


def test_the_headroom_check_reads_the_late_window_and_flags_the_ceiling():
    """Late accuracy per seed and its mean, the ceiling at 0.85 (TROLL at 0.86 has not kept its
    headroom), and the share of groups without spread over rollouts 71-80."""
    records = [record("troll", 0, 0.86, zero=0.75), record("troll", 1, 0.88, zero=0.25)]
    records += [record("clip", 0, 0.40, zero=0.5), record("clip", 1, 0.42, zero=0.5)]
    rows = tables.headroom_check(records, *ARMS).splitlines()[2:]
    troll, clip = (row.split(" | ") for row in rows)
    assert troll[1:5] == ["0.860, 0.880", "0.870", "no: 0.870 >= 0.85", "50.0%"]
    assert clip[1:5] == ["0.400, 0.420", "0.410", "yes", "50.0%"]


def test_the_bins_table_means_each_bins_share_over_the_window_only():
    """A share of 0.1 before rollout 61 and 0.3 from it: the window 61-80 reads 30.00%, the whole
    run the mean of its 80 rollouts; a bin no run logs is a dash."""
    key = "trust_region/by_confidence/below_0.5/projected"
    run = record("troll", 0, 0.5)
    for row in run["history"][1:]:
        row[key] = 0.3 if row["rollout"] >= 61 else 0.1
        row["trust_region/by_confidence/below_0.5/tokens"] = 0.2
    window = regime.bins_table({"troll": [run]}, tables.BINS_WINDOW).splitlines()
    whole = regime.bins_table({"troll": [run]}).splitlines()
    assert window[2].split(" | ")[:4] == ["| troll", "projected", "30.00%", "-"]
    assert whole[2].split(" | ")[2] == f"{(60 * 0.1 + 20 * 0.3) / 80:.2%}"
    assert window[3].split(" | ")[1:3] == ["tokens", "20.00%"]


def test_the_report_writes_the_verdict_and_the_bins_plot(tmp_path, capsys):
    """Five paired seeds with TROLL ahead on each: verdict.md names the outcome, bins.png and
    zero_std.png are drawn, the headroom check is in."""
    pytest.importorskip("matplotlib")
    projected = {f"trust_region/by_confidence/{b}/projected": 0.02 for b in regime.CONFIDENCE}
    clipped = {f"trust_region/by_confidence/{b}/clipped": 0.01 for b in regime.CONFIDENCE}
    records = [record("troll", s, 0.5 + s / 100, **projected) for s in range(5)]
    records += [record("clip", s, 0.45, **clipped) for s in range(5)]
    tables.report(records, 1e-5, tmp_path)
    text = (tmp_path / "verdict.md").read_text()
    assert "seeds 0, 1, 2, 3, 4: TROLL ahead: +0.070" in text
    assert "| troll lr 1e-05 | 0.500, 0.510, 0.520, 0.530, 0.540 | 0.520 | yes |" in text
    assert (tmp_path / "bins.png").stat().st_size > 0
    assert (tmp_path / "zero_std.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
