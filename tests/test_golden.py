"""The golden runs (``tests/golden.py``) give the weights and logged figures they were recorded
with: a reorganisation of the library changes no number."""

from __future__ import annotations

import json

import pytest

from tests import golden


@pytest.mark.parametrize("name", sorted(golden.RUNS))
def test_the_golden_run_gives_its_recorded_weights_and_figures(name, tmp_path, monkeypatch):
    stored = json.loads(golden.FIXTURE.read_text())
    monkeypatch.chdir(tmp_path)
    record = golden.fit(name, tmp_path)
    exact = stored["machine"] == golden.machine()
    assert golden.differences(stored["runs"][name], record, exact) == []


def test_a_changed_number_is_found():
    stored = json.loads(golden.FIXTURE.read_text())["runs"]["troll"]
    changed = json.loads(json.dumps(stored))
    changed["scalars"]["reward/mean"][1] += 1e-12
    assert golden.differences(stored, changed, exact=True) == [
        f"reward/mean: {stored['scalars']['reward/mean']} -> {changed['scalars']['reward/mean']}"
    ]
    assert golden.differences(stored, changed, exact=False) == []
    changed["weights_sha256"] = "0" * 64
    changed["scalars"].pop("entropy")
    assert golden.differences(stored, changed, exact=True)[:2] == [
        "the final weights differ (sha256)",
        "logged figures: missing ['entropy'], new []",
    ]


def test_elsewhere_the_loose_comparison_still_finds_a_change_past_its_tolerances():
    """A machine of another kind than the recording one compares within ``golden.LOOSE``: a
    figure moved by 1e-3 relative is found, one moved by 1e-4 is not; a token count (the
    support) may move by 5e-3 but not by 2e-2."""
    stored = json.loads(golden.FIXTURE.read_text())["runs"]["troll"]
    for key, factor, found in [
        ("grad_norm", 1 + 1e-4, False),
        ("grad_norm", 1 + 1e-3, True),
        ("sparsity/support_mean", 1 + 5e-3, False),
        ("sparsity/support_mean", 1 + 2e-2, True),
    ]:
        changed = json.loads(json.dumps(stored))
        changed["scalars"][key][0] *= factor
        assert bool(golden.differences(stored, changed, exact=False)) is found, (key, factor)


def test_the_machine_kind_names_the_processor(monkeypatch):
    """Two processors with the same torch and kernels differ in the last bits: the kind that
    compares bit for bit names the processor, from /proc/cpuinfo or, without it, ``platform``."""
    import platform
    from pathlib import Path

    kind = golden.machine()
    assert set(kind) == {"torch", "cpu", "processor"}
    assert kind["processor"].strip()

    def unreadable(self, *args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(Path, "read_text", unreadable)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert golden.processor() == "arm"
