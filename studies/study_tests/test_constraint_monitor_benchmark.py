"""What the constraint bins cost (studies/benchmark_constraint_monitor.py), loaded as the study
scripts are; the bins themselves are tested in tests/test_constraint_monitor.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from lightning_troll.callbacks import ConstraintMonitor

from .helpers import load


def test_the_cost_benchmark_times_both_monitors_on_both_objectives(tmp_path):
    """studies/benchmark_constraint_monitor.py on a small rollout: a row per objective with
    positive times, and the synthetic statistics it times log every bin of both objectives."""
    bench = load("benchmark_constraint_monitor")
    out = tmp_path / "cost.json"
    bench.main(["--tokens", "800", "--repeats", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["objective"], r["tokens"]) for r in rows] == [("troll", 800), ("clip", 800)]
    assert all(r["constraint_monitor_s"] > 0 and r["trust_region_monitor_s"] > 0 for r in rows)
    generator = torch.Generator().manual_seed(0)
    for objective, masks in (("troll", ["projected"]), ("clip", ["clipped", "outside"])):
        stats = [bench.step_stats(objective, 100, generator) for _ in range(2)]
        module = SimpleNamespace(last_stats=stats, device=torch.device("cpu"), logged={})
        module.log_dict = lambda values, m=module: m.logged.update(values)
        ConstraintMonitor().on_train_batch_end(None, module, None, None, 0)
        for mask in masks:
            assert f"trust_region/by_confidence/below_0.5/{mask}" in module.logged
