"""The studies' shared machinery (studies/study_kit.py, with its tables and plots in
studies/study_figures.py), and the size of every example; the studies built on it have files
of their own (test_paper_regime_study.py, ...)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .helpers import EXAMPLES, STUDIES, load

MAX_LINES = 400
"""The most lines an example script may have: past it, split the script by concern (the studies
share this machinery for that reason)."""


kit = load("study_kit")
paper = load("paper_regime_study")
tables = load("paper_regime_tables")


def test_read_history_merges_attempts_later_rows_winning(tmp_path):
    """Attempt 0 logged rollouts 1-3, attempt 1 (a resume) ran rollout 3 again and 4: rollout 3
    takes attempt 1's value; metrics outside the list are dropped; steps count from 0."""
    for version, rows in ((0, [(0, 0.1), (1, 0.2), (2, 0.3)]), (1, [(2, 0.35), (3, 0.4)])):
        folder = tmp_path / f"version_{version}"
        folder.mkdir()
        lines = ["step,reward/mean,other"] + [f"{s},{v},9" for s, v in rows]
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    history = kit.read_history(tmp_path, ["reward/mean"])
    assert history == [
        {"rollout": 1, "reward/mean": 0.1},
        {"rollout": 2, "reward/mean": 0.2},
        {"rollout": 3, "reward/mean": 0.35},
        {"rollout": 4, "reward/mean": 0.4},
    ]


def test_a_killed_attempt_counts_its_rollouts_time_and_an_older_list_the_last_attempts(tmp_path):
    """Three attempts logged: version 0 returned after 50 s; version 1's process was killed (no
    seconds kept), so it counts its rollouts' time/iteration, 7 + 8 = 15 s; version 2 returned
    after 30 s: 95 s over 3 attempts. A list, as older runs kept, is the last attempts'."""
    logs = tmp_path / "logs"
    for version, times in ((0, [20, 20]), (1, [7, 8]), (2, [9])):
        folder = logs / f"version_{version}"
        folder.mkdir(parents=True)
        lines = ["step,time/iteration"] + [f"{s},{t}" for s, t in enumerate(times)]
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    assert kit.attempts_spent(logs, {"0": 50.0, "2": 30.0}) == (95.0, 3)
    stored = tmp_path / "attempts.json"
    stored.write_text(json.dumps([30.0]))  # only the last attempt returned
    assert kit.measured_attempts(stored, logs) == {"2": 30.0}
    assert kit.attempts_spent(logs, kit.measured_attempts(stored, logs)) == (20 + 20 + 15 + 30, 3)
    assert kit.measured_attempts(tmp_path / "none.json", logs) == {}


def record(objective, lr, accuracies, active):
    history = [
        {"rollout": 5 * i, "val/accuracy": a, tables.ACTIVE[objective]: active}
        for i, a in enumerate(accuracies)
    ]
    return {
        "name": f"{objective}-{lr}",
        "fields": {"objective": objective, "lr": lr},
        "history": history,
    }


def test_choose_lrs_takes_the_best_pilot_whose_constraint_acts():
    """clip at 1e-6 scores best but clips nothing (plain policy gradient): 3e-6 is chosen; TROLL's
    best acting pilot is 1e-5. Scores are the mean of the last 2 validations."""
    pilots = [
        record("clip", 1e-6, [0.5, 0.9, 0.9], 0.0),
        record("clip", 3e-6, [0.5, 0.7, 0.8], 0.01),
        record("clip", 1e-5, [0.5, 0.8, 0.6], 0.05),
        record("troll", 1e-6, [0.5, 0.6, 0.6], 0.0),
        record("troll", 1e-5, [0.5, 0.7, 0.7], 0.02),
    ]
    assert paper.pilot_score(pilots[1]) == pytest.approx(0.75)
    assert paper.choose_lrs(pilots) == {"clip": 3e-6, "troll": 1e-5}
    # where no pilot's constraint acts, the best of all is taken (and the table shows 0%)
    assert paper.choose_lrs([pilots[0], pilots[3]]) == {"clip": 1e-6, "troll": 1e-6}


def test_tables_compare_on_the_validations_every_run_shares():
    """Two seeds of each arm, validated at 0, 5, ..., 30; TROLL's seed 0 also at rollout 7 (a
    stop on the way out). The shared points are 5-30, cut into thirds (5-10, 15-20, 25-30);
    rollout 7's 0.0 enters no figure. Late (25-30): TROLL 0.9 and 0.8, clipping 0.7 and 0.7:
    per-seed differences +0.2 and +0.1, mean +0.15, t = 0.15 / (0.0707 / sqrt 2) = 3.0 with
    1 degree of freedom, two-sided p = 1 - 2 atan(3) / pi = 0.205; the sign test on 2 of 2 gives 0.5."""

    def run(objective, seed, accuracies, extra=None):
        history = [{"rollout": 5 * i, "val/accuracy": a} for i, a in enumerate(accuracies)]
        if extra is not None:
            history.insert(2, {"rollout": 7, "val/accuracy": extra})
        for row in history:
            row.update({tables.REWARD: 0.5, "entropy": 0.1, kit.TIME: 60.0})
        fields = {"objective": objective, "lr": 3e-6, "seed": seed}
        return {"name": f"{objective}-s{seed}", "fields": fields, "history": history}

    records = [
        run("troll", 0, [0.4, 0.6, 0.6, 0.6, 0.6, 0.9, 0.9], extra=0.0),
        run("troll", 1, [0.4, 0.5, 0.5, 0.5, 0.5, 0.8, 0.8]),
        run("clip", 0, [0.4, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7]),
        run("clip", 1, [0.4, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7]),
    ]
    assert tables.shared_rollouts(records) == [5, 10, 15, 20, 25, 30]
    assert tables.thirds([5, 10, 15, 20, 25, 30]) == [(5, 10), (15, 20), (25, 30)]
    assert tables.thirds(list(range(5, 65, 5))) == [(5, 20), (25, 40), (45, 60)]
    row = tables.main_table(records).splitlines()[2].split(" | ")
    assert row[0] == "| troll lr 3e-06" and row[2] == "0.900, 0.800"
    assert row[4] == f"{(0.6 + 0.5) / 2:.3f}"  # rollouts 5-10, without rollout 7's 0.0
    lines = tables.paired_table(records, "troll lr 3e-06", "clip lr 3e-06").splitlines()
    late = next(line for line in lines if "| 25, 30 |" in line)
    assert "+0.150 (+0.200, +0.100); t-test p 0.20, sign test p 0.50" in late
    assert not any("| 5, 7" in line for line in lines)


def test_paired_tests_match_the_t_tables_and_exact_sign_test():
    """Two-sided 5% points of Student's t: 12.706 (1 df), 4.303 (2), 2.776 (4), 2.228 (10);
    the sign test on n of n equal signs gives 2 / 2^n."""
    stats = load("study_stats")
    for t, df in ((12.7062, 1), (4.302653, 2), (2.776445, 4), (2.228139, 10)):
        assert stats.t_two_sided(t, df) == pytest.approx(0.05, abs=1e-5)
    assert stats.t_two_sided(0.0, 3) == pytest.approx(1.0)
    assert stats.sign_test([1, 2, 3]) == 0.25 and stats.sign_test([1, -1, 2, 3, 4]) == 0.375
    # the paper-regime study's late gap as the page gave it: p 0.04 with 2 df, sign test 0.25
    late = stats.paired([0.887, 0.881, 0.881], [0.832, 0.849, 0.814])
    assert late.diffs == pytest.approx((0.055, 0.032, 0.067))
    assert late.p_t == pytest.approx(0.04, abs=0.005) and late.p_sign == 0.25
    equal = stats.paired([1.0, 2.0], [0.5, 1.5])
    assert equal.t == math.inf and equal.p_t == 0.0
    one = stats.paired([0.4], [0.5])
    assert (
        math.isnan(one.p_t)
        and one.text() == "-0.100 (-0.100); no t-test (one seed), sign test p 1.00"
    )
    with pytest.raises(ValueError, match="equal, non-empty"):
        stats.paired([1.0], [1.0, 2.0])


@pytest.mark.parametrize(
    "path", sorted([*STUDIES.glob("*.py"), *EXAMPLES.glob("*.py")]), ids=lambda p: p.name
)
def test_every_script_is_at_most_400_lines(path):
    lines = len(path.read_text().splitlines())
    where = f"{path.parent.name}/{path.name}"
    assert lines <= MAX_LINES, f"{where} has {lines} lines; split it by concern"


def test_grid_refuses_other_settings_in_the_same_folder(tmp_path):
    kit.Grid(tmp_path, {"prompts": 16}, []).check_settings()
    with pytest.raises(ValueError, match="holds runs made with"):
        kit.Grid(tmp_path, {"prompts": 8}, []).check_settings()


def test_write_atomic_leaves_no_partial_file(tmp_path):
    kit.write_atomic(tmp_path / "a.json", "[1]")
    assert (tmp_path / "a.json").read_text() == "[1]"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def finished(name, fields, accuracies, seconds=60.0, time=2.0):
    """A record with held-out accuracy ``accuracies[i]`` at rollout ``i`` (0: the start), each
    rollout timed at ``time`` seconds."""
    history = [{"rollout": 0, "val/accuracy": accuracies[0]}]
    history += [
        {"rollout": i, "val/accuracy": a, kit.TIME: time}
        for i, a in enumerate(accuracies[1:], start=1)
    ]
    return {"name": name, "fields": fields, "seconds": seconds, "attempts": 1, "history": history}


def test_estimate_takes_the_median_rollout_and_the_median_time_outside_rollouts(tmp_path):
    """Two runs of 1 rollout timed at 2 s, 60 and 120 s in all: outside rollouts 58 and 118 s per
    rollout, median 88, so 90 s per rollout; 3 runs of 1 rollout = 270 s, one left (90 s). A
    third run with a rollout paused for an hour (3658 s in all, 58 outside) moves neither median."""
    runs = [kit.Run(n, (), 1, 1) for n in ("a", "b", "c")]
    grid = kit.Grid(tmp_path, {}, ["val/accuracy", kit.TIME], prior_seconds=60.0)
    assert grid.estimate(runs) == (3 * 60.0 / 3600, 3 * 60.0 / 3600)  # no run done: the prior
    done = [finished("a", {}, [0.4, 0.5]), finished("b", {}, [0.4, 0.6], seconds=120.0)]
    grid.write(done)
    assert grid.estimate(runs) == pytest.approx((3 * 90.0 / 3600, 90.0 / 3600), rel=1e-12)
    paused = finished("c", {}, [0.4, 0.5], seconds=3658.0, time=3600.0)
    grid.write([*done, paused])
    assert grid.estimate(runs) == pytest.approx((3 * 60.0 / 3600, 0.0), rel=1e-12)


def test_records_round_trip_through_results_and_metrics_and_keep_other_grids_runs(tmp_path):
    grid = kit.Grid(tmp_path, {}, ["val/accuracy", kit.TIME])
    a = finished("a", {"objective": "clip", "lr": None}, [0.4, 0.5])
    b = finished("b", {"objective": "troll", "lr": 1e-5}, [0.4, 0.625])
    grid.write([a, b])
    assert grid.finished([kit.Run("b", (), 1, 1), kit.Run("a", (), 1, 1)]) == [b, a]
    grid.write([a])  # b belongs to another grid now: kept in the outputs
    assert sorted(grid.recorded()) == ["a", "b"]
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["name", "lr", "objective", "rollout", "val/accuracy", kit.TIME]
    assert [(r["name"], r["lr"], r["rollout"]) for r in rows] == [
        ("a", "", "0"), ("a", "", "1"), ("b", "1e-05", "0"), ("b", "1e-05", "1"),
    ]  # fmt: skip


def test_processes_sharing_a_folder_write_its_records_one_at_a_time(tmp_path):
    """Two processes of one study (one per seed) finish runs at about the same time: a write
    waits for the folder's lock, so neither drops the other's run nor writes into the file the
    other writes (each its own partial file), and the second keeps the first's run."""
    import subprocess
    import sys
    import threading

    grid = kit.Grid(tmp_path, {}, ["val/accuracy", kit.TIME])
    grid.write([finished("a", {"seed": 0}, [0.4, 0.5])])
    holder = subprocess.Popen(  # another process holds the lock while it writes
        [sys.executable, "-c", "import fcntl, sys, time\n"
         f"f = open({str(tmp_path / '.records.lock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True); time.sleep(1.5)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    writer = threading.Thread(target=grid.write, args=([finished("b", {"seed": 1}, [0.4, 0.6])],))
    writer.start()
    writer.join(timeout=0.5)
    assert writer.is_alive()  # waiting for the lock
    holder.wait(timeout=30)
    writer.join(timeout=30)
    assert not writer.is_alive() and sorted(grid.recorded()) == ["a", "b"]
    assert not list(tmp_path.glob("*.partial"))


def test_outputs_of_the_older_layout_are_read_as_they_are(tmp_path):
    """Records that keep their fields beside the name, settings and start kept in runs/: the
    fields are read into ``fields`` (absent ones as None, the rest of the record kept), and the
    two files move up where the grid keeps them."""
    old = {"objective": "clip", "seed": 0, "name": "a", "seconds": 5.0, "final_accuracy": 0.5}
    (tmp_path / "results.json").write_text(json.dumps([old]))
    (tmp_path / "metrics.csv").write_text(
        "name,objective,seed,rollout,val/accuracy\na,clip,0,0,0.25\na,clip,0,1,0.5\n"
    )
    (tmp_path / "runs" / "b").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "result.json").write_text(json.dumps({**old, "name": "b"}))
    (tmp_path / "runs" / "settings.json").write_text(json.dumps({"prompts": 8}))
    (tmp_path / "runs" / "start.json").write_text(json.dumps({"rollout": 0, "val/accuracy": 0.25}))
    grid = kit.Grid(
        tmp_path,
        {"prompts": 8},
        ["val/accuracy"],
        lambda: 1 / 0,
        legacy_fields=("objective", "seed", "eps"),
    )
    a, b = grid.finished([kit.Run("a", (), 1, 1), kit.Run("b", (), 1, 1)])
    assert a == {
        "name": "a",
        "fields": {"objective": "clip", "seed": 0, "eps": None},
        "seconds": 5.0,
        "final_accuracy": 0.5,
        "history": [{"rollout": 0, "val/accuracy": 0.25}, {"rollout": 1, "val/accuracy": 0.5}],
    }
    assert b["fields"] == a["fields"] and "objective" not in b
    grid.check_settings()  # the same settings: accepted
    assert grid._start() == [{"rollout": 0, "val/accuracy": 0.25}]  # not validated again
    assert not (tmp_path / "runs" / "settings.json").exists() and (tmp_path / "start.json").exists()


def fake_cli(calls, steps, stopped_by=None):
    """A stand-in for ``lightning-troll``: records the arguments, writes one CSV log row per
    optimiser step it was asked for (as rollouts of 1 step), and ends at ``steps``."""

    def run(args):
        calls.append(args)
        logger = json.loads(args[args.index("--trainer.logger") + 1])["init_args"]
        log = Path(logger["save_dir"]) / logger["name"] / f"version_{logger['version']}"
        log.mkdir(parents=True)
        lines = ["step,reward/mean"] + [f"{s},{s / 10}" for s in range(steps)]
        (log / "metrics.csv").write_text("\n".join(lines) + "\n")
        stopper = SimpleNamespace(stopped_by=stopped_by)
        return SimpleNamespace(
            trainer=SimpleNamespace(global_step=steps), checkpoint_callback=stopper
        )

    return run


def test_train_adds_logging_and_checkpoints_resumes_and_raises_when_stopped(tmp_path, monkeypatch):
    """A run stopped by SIGTERM (15) after 2 of 3 steps raises with exit code 143 and keeps its
    first attempt; the next attempt logs to version_1, resumes from last.ckpt, and the record
    merges both logs and adds the start row and the figures of its history."""
    calls: list[list[str]] = []
    run = kit.Run("r", ("--config", "c.yaml"), 3, 3, {"seed": 0})
    grid = kit.Grid(
        tmp_path, {}, ["reward/mean"], checkpoint_every=2, figures=lambda h: {"rows": len(h)}
    )
    run_dir = tmp_path / "runs" / "r"
    monkeypatch.setattr(kit, "cli", fake_cli(calls, 2, stopped_by=15))
    with pytest.raises(kit.Interrupted) as stopped:
        grid.train(run, run_dir, [{"rollout": 0}])
    assert stopped.value.exit_code == 143
    first = dict(zip(calls[0][1::2], calls[0][2::2], strict=True))
    assert calls[0][:3] == ["fit", "--config", "c.yaml"] and first["--trainer.max_steps"] == "3"
    assert first["--checkpoint.dirpath"] == str(run_dir / "checkpoints")
    assert first["--checkpoint.every_n_rollouts"] == "2" and "--ckpt_path" not in first
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_text("")
    monkeypatch.setattr(kit, "cli", fake_cli(calls, 3))
    record = grid.train(run, run_dir, [{"rollout": 0}])
    again = dict(zip(calls[1][1::2], calls[1][2::2], strict=True))
    assert json.loads(again["--trainer.logger"])["init_args"]["version"] == 1
    assert again["--ckpt_path"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert record["attempts"] == 2 and record["fields"] == {"seed": 0} and record["rows"] == 4
    assert [row["rollout"] for row in record["history"]] == [0, 1, 2, 3]


def test_resumable_ends_a_stopped_study_with_the_signals_status_and_lets_other_errors_through(
    capsys,
):
    with pytest.raises(SystemExit) as ended, kit.resumable():
        raise kit.Interrupted("troll-s0", 143)
    assert ended.value.code == 143
    assert capsys.readouterr().out == (
        "troll-s0 stopped before its last rollout; the same command resumes it\n"
    )
    with pytest.raises(ValueError, match="not a stop"), kit.resumable():
        raise ValueError("not a stop")
    with kit.resumable():
        done = "ran"
    assert done == "ran" and capsys.readouterr().out == ""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_no_run_trains_ends_the_study_in_one_line(signum, capsys):
    """Between runs (or while one sets up) nothing is there to save: the study ends at once, with
    the signal's exit status and a line, and the handlers are as they were afterwards."""
    before = signal.getsignal(signum)
    with pytest.raises(SystemExit) as ended, kit.resumable():
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler runs before this ends
    assert ended.value.code == 128 + signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().out == (
        f"{name} received while no run was training: the study stops here, nothing to save; "
        "the same command goes on from here\n"
    )
    assert signal.getsignal(signum) is before


def test_run_all_skips_finished_runs_and_starts_over_one_without_a_checkpoint(
    tmp_path, monkeypatch
):
    """``a`` finished (its result.json), ``b`` left files but no checkpoint: only ``b`` trains,
    in a cleared folder, after the start row was made once (with its seconds in start.json)."""
    runs = [kit.Run("a", (), 1, 1), kit.Run("b", (), 1, 1)]
    starts = []

    def start() -> dict:
        starts.append(1)
        return {"rollout": 0, "val/accuracy": 0.4}

    grid = kit.Grid(tmp_path, {"x": 1}, ["val/accuracy", kit.TIME], start)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "result.json").write_text(json.dumps(finished("a", {}, [0.4, 0.9])))
    (tmp_path / "runs" / "b").mkdir()
    (tmp_path / "runs" / "b" / "stale.txt").write_text("left by a killed run")
    trained = []

    def train(run, run_dir, start):
        assert not (run_dir / "stale.txt").exists(), "the interrupted run's folder is cleared"
        trained.append(run.name)
        return finished(run.name, {}, [start[0]["val/accuracy"], 0.7])

    monkeypatch.setattr(grid, "train", train)
    records = grid.run_all(runs)
    assert trained == ["b"] and starts == [1]
    assert [r["history"][-1]["val/accuracy"] for r in records] == [0.9, 0.7]
    assert set(json.loads((tmp_path / "start.json").read_text())) == {
        "rollout",
        "val/accuracy",
        "seconds",
    }
    assert grid.run_all(runs) == records and trained == ["b"] and starts == [1]  # all done now
    written = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["name"] for r in written) == ["a", "b"]


def test_a_signal_in_a_runs_last_rollout_stops_the_grid_before_the_next_run(
    tmp_path, monkeypatch, capsys
):
    """SIGINT (2) lands while ``a`` trains its last rollout: ``a`` finishes and is recorded, ``b``
    does not start, and the study ends with status 130 saying the same command goes on; run
    again, it trains ``b``. A signal in the grid's last run ends it normally."""
    runs = [kit.Run("a", (), 1, 1), kit.Run("b", (), 1, 1)]
    grid = kit.Grid(tmp_path, {}, ["val/accuracy", kit.TIME])
    trained = []

    def train(run, run_dir, start):
        trained.append(run.name)
        grid.stopped_by = 2
        return finished(run.name, {}, [0.4, 0.7])

    monkeypatch.setattr(grid, "train", train)
    with pytest.raises(SystemExit) as ended, kit.resumable():
        grid.run_all(runs)
    assert ended.value.code == 130 and trained == ["a"]
    assert (tmp_path / "runs" / "a" / "result.json").exists()
    assert "a finished; the grid stopped before the next run; the same command goes on with " \
        "the next run" in capsys.readouterr().out  # fmt: skip
    records = grid.run_all(runs)  # b is the last run left: its signal ends nothing
    assert trained == ["a", "b"] and [r["name"] for r in records] == ["a", "b"]


def test_markdown_table_aligns_the_columns_it_is_told():
    text = kit.markdown_table(["a", "b", "c"], [["1", "2", "3"]], "lr")
    assert text == "| a | b | c |\n| --- | ---: | --- |\n| 1 | 2 | 3 |\n"


def test_curve_averages_over_runs_at_the_rollouts_every_run_logged():
    a = finished("a", {}, [0.2, 0.4])
    b = finished("b", {}, [0.4, 0.8, 0.9])  # rollout 2 only in b: left out
    steps, mean, std = kit.curve([a, b], "val/accuracy")
    assert steps == [0, 1]
    assert mean == pytest.approx([0.3, 0.6], rel=1e-12)
    assert std == pytest.approx([0.02**0.5, 0.08**0.5], rel=1e-12)  # sample std of two values
    assert kit.curve([], "val/accuracy") == ([], [], [])


def test_plot_panels_writes_one_png_of_all_panels(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [finished("a", {}, [0.4, 0.5]), finished("b", {}, [0.4, 0.7])]
    panels = [
        kit.Panel("both", "accuracy", [kit.Line(runs, "val/accuracy", "mean", "tab:blue")],
                  hlines=[(0.5, "a bound")], top=1.0),
        kit.Panel("nothing logged", "KL", [kit.Line(runs, "absent", "none")], log=True),
    ]  # fmt: skip
    path = kit.plot_panels(panels, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
