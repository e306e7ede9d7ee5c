"""Every figure in every logger: the samples table, the per-token histograms and the chart of KL
against the bound reach CSV, MLflow (a file store) and W&B (offline), and a reward that hangs is
counted in the logger's metrics while the run finishes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_troll.callbacks.figures import markdown_table
from lightning_troll.tasks.rewards.options import RewardOptions
from tests.test_training import fit, make_data, make_module, make_trainer

HISTOGRAMS = ("kl_before", "kl_after", "eta", "support_size")
TABLE_COLUMNS = {"step", "prompt", "completion", "reward", "advantage"}


def _csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_scalar_logger_gets_the_quantiles_of_more_values_than_torch_quantile_takes(tmp_path):
    """A rollout's per-token values can number over 2**24 (a large rollout times its optimiser
    steps), which ``torch.quantile`` refuses: the quantiles for a logger of scalars still come,
    and right (0, 1, ..., n - 1 has its median at (n - 1) / 2)."""
    import torch

    from lightning_troll.callbacks.figures import QUANTILES, write_histogram

    n = 2**24 + 2
    logger = CSVLogger(tmp_path, name="q")
    write_histogram(logger, "kl", torch.arange(n, dtype=torch.float32), step=3)
    logger.save()
    (row,) = _csv_rows(logger)
    assert float(row["kl/p50"]) == (n - 1) / 2 and row["step"] == "3"
    assert {f"kl/p{round(q * 100):02d}" for q in QUANTILES} <= set(row)


def test_markdown_table_escapes_cells_and_writes_numbers_short():
    table = markdown_table(["prompt", "reward"], [["a|b\nc", 0.123456], ["d", 2.0]])
    assert table.splitlines() == [
        "| prompt | reward |",
        "| --- | --- |",
        "| `a\\|b⏎c` | 0.123 |",
        "| `d` | 2 |",
    ]


@pytest.mark.slow
def test_csv_logger_gets_metrics_quantiles_and_samples(tmp_path, tiny_model_dir):
    logger = CSVLogger(tmp_path, name="csv")
    fit(tmp_path, tiny_model_dir, max_steps=2, logger=logger)
    rows = _csv_rows(logger)
    columns = set(rows[0])
    assert {"trust_region/kl_after_max", "trust_region/bound", "rewards/timeouts"} <= columns
    for name in HISTOGRAMS:  # histograms as quantiles, p05 <= p50 <= p95
        tag = f"trust_region/{name}_per_token"
        assert {f"{tag}/p05", f"{tag}/p50", f"{tag}/p95"} <= columns, tag
        for row in rows:
            if row[f"{tag}/p50"]:
                assert (
                    float(row[f"{tag}/p05"]) <= float(row[f"{tag}/p50"]) <= float(row[f"{tag}/p95"])
                )
    samples = _jsonl(Path(logger.log_dir) / "samples.jsonl")
    assert len(samples) == 4  # log_samples=2, every rollout, 2 rollouts
    assert set(samples[0]) == TABLE_COLUMNS
    assert [s["step"] for s in samples] == [0, 0, 1, 1]
    # every figure of a rollout sits at its scalars' step (one per rollout, not per optimiser step)
    scalars = {row["step"] for row in rows if row["trust_region/kl_after_max"]}
    quantiles = {row["step"] for row in rows if row["trust_region/kl_after_per_token/p50"]}
    assert scalars == quantiles == {"0", "1"}


@pytest.mark.slow
def test_mlflow_logger_gets_metrics_samples_and_the_chart(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked for
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    logger = MLFlowLogger(experiment_name="troll", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    fit(tmp_path, tiny_model_dir, max_steps=2, logger=logger)
    client, run_id = logger.experiment, logger.run_id
    assert len(client.get_metric_history(run_id, "trust_region/kl_after_max")) == 2
    assert len(client.get_metric_history(run_id, "trust_region/bound")) == 2
    assert client.get_metric_history(run_id, "trust_region/eta_per_token/p50")
    artifacts = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert artifacts == {"samples/step_0000000.jsonl", "samples/step_0000001.jsonl"}
    local = Path(client.download_artifacts(run_id, "samples/step_0000001.jsonl", str(tmp_path)))
    assert set(_jsonl(local)[0]) == TABLE_COLUMNS
    chart = client.download_artifacts(
        run_id, "charts/KL_after_projection_vs_bound.json", str(tmp_path)
    )
    series = json.loads(Path(chart).read_text())
    assert series["step"] == [0, 1]  # the steps of the rollouts' scalars, as every figure's
    assert series["trust_region/bound"] == [0.05, 0.05]
    steps = [m.step for m in client.get_metric_history(run_id, "trust_region/kl_after_max")]
    assert steps == series["step"]


@pytest.mark.slow
def test_wandb_offline_gets_tables_histograms_and_a_line_plot(
    tmp_path, tiny_model_dir, monkeypatch
):
    pytest.importorskip("wandb")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="troll", save_dir=str(tmp_path), offline=True)
    try:
        fit(tmp_path, tiny_model_dir, max_steps=2, logger=logger)
        summary = dict(logger.experiment.summary)
        run_dir = Path(logger.experiment.dir)
    finally:
        wandb.finish()
    assert summary["samples"]["_type"] == "table-file"
    for name in HISTOGRAMS:
        assert summary[f"trust_region/{name}_per_token"]["_type"] == "histogram", name
    assert "KL after projection vs bound_table" in summary  # the line_series custom chart
    assert "trust_region/kl_after_max" in summary
    tables = list(run_dir.rglob("samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "advantage"]


@pytest.mark.slow
def test_a_reward_that_hangs_times_out_and_the_run_finishes(tmp_path, tiny_model_dir):
    """hangs_on_a_third sleeps for ever on about a third of the completions: with 2 workers and
    a 2 s timeout each such call is abandoned and scored 0.0, two rollouts and a validation
    finish, and metrics.csv counts the timeouts."""
    module = make_module(
        tiny_model_dir,
        rewards={"tests.reward_helpers:hangs_on_a_third": 1.0},
        reward_options=RewardOptions(on_error=0.0, workers=2, timeout=2.0),
    )
    logger = CSVLogger(tmp_path, name="csv")
    trainer = make_trainer(tmp_path, 2, logger=logger)
    with pytest.warns(UserWarning, match="timed out after 2 s"):
        trainer.fit(module, datamodule=make_data(tiny_model_dir, batch_size=2, num_val=4))
    module.scorer.close()
    assert trainer.global_step > 0
    counts = [float(r["rewards/timeouts"]) for r in _csv_rows(logger) if r["rewards/timeouts"]]
    errors = [float(r["rewards/errors"]) for r in _csv_rows(logger) if r["rewards/errors"]]
    assert len(counts) == 2 and sum(counts) > 0 and errors == [0.0, 0.0]
