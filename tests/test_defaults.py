"""One default per option: the Python API (``TrollObjective()``, ``ClipObjective()``,
``TrustRegionProjection()``, the objectives' shared loss options), the records behind the YAML and
the command line's default configuration agree on every option they share."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from lightning_troll import ClipObjective, TrollObjective, TrustRegionProjection
from lightning_troll.cli.command import run
from lightning_troll.objectives.base import PolicyObjective
from lightning_troll.objectives.options import ClipConfig, LossConfig, TrustRegionConfig

RENAMED = {"keep_token": "keep_sampled_token"}
"""The projection's argument names that the YAML spells otherwise."""


def signature_defaults(function) -> dict:
    return {
        RENAMED.get(name, name): p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize(
    ("record", "function"),
    [
        (TrustRegionConfig, TrollObjective),
        (TrustRegionConfig, TrustRegionProjection),
        (ClipConfig, ClipObjective),
        (LossConfig, PolicyObjective),
    ],
)
def test_the_python_api_takes_the_records_defaults(record, function):
    fields = {f.name: f.default for f in dataclasses.fields(record)}
    given = signature_defaults(function)
    shared = set(fields) & set(given)
    assert len(shared) >= 3  # the names line up (a rename would leave nothing to compare)
    assert {name: given[name] for name in shared} == {name: fields[name] for name in shared}


def test_built_objects_hold_the_defaults():
    config = TrustRegionConfig()
    projection = TrollObjective().projection
    assert (projection.eps, projection.max_tokens, projection.mass_delta, projection.support) == (
        config.eps, config.max_tokens, config.mass_delta, config.support
    )  # fmt: skip
    layer = TrustRegionProjection()
    assert (layer.eps, layer.max_tokens, layer.keep_token, layer.support) == (
        config.eps, config.max_tokens, config.keep_sampled_token, config.support
    )  # fmt: skip
    assert TrollObjective().alpha == config.alpha
    clip = ClipObjective()
    assert (clip.eps_low, clip.eps_high, clip.dual_clip) == (0.2, 0.2, None) == (
        ClipConfig.eps_low, ClipConfig.eps_low, ClipConfig.dual_clip
    )  # fmt: skip


def test_the_command_lines_defaults_are_the_records(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run(["fit", "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    for key, record in (("trust_region", TrustRegionConfig), ("clip", ClipConfig),
                        ("loss", LossConfig)):  # fmt: skip
        assert model[key] == dataclasses.asdict(record()), key


def test_the_official_supports_sampled_token_is_checked_once_in_one_wording():
    message = "trust_region.keep_sampled_token=False needs trust_region.support 'union' or 'dense'"
    with pytest.raises(ValueError, match=message):
        TrustRegionConfig(keep_sampled_token=False)
    with pytest.raises(ValueError, match=message):
        TrustRegionProjection(keep_token=False, support="official")
    assert TrustRegionProjection(keep_token=False, support="union").keep_token is False
