"""The lightning-troll command: every config parses, CPU configs run a step, help and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_troll.cli import run as cli_run
from lightning_troll.objectives import ClipObjective, TrollObjective

pytestmark = pytest.mark.slow  # whole fits: seconds each

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PRESETS = ["grpo.yaml", "dr_grpo.yaml", "gspo.yaml", "reinforce_pp.yaml", "dapo.yaml"]
# configs that need a GPU or the network: parsed only; smollm2.yaml needs `make smollm2` and runs
# in tests/test_real_model.py
PARSE_ONLY = {"gsm8k.yaml", "smollm2.yaml"}
# overlays for several processes, and the config each goes on top of
OVERLAYS = {"fsdp2_cpu.yaml": "tinymath.yaml", "fsdp2.yaml": "gsm8k.yaml"}
# GPU-oriented overlays of memory options: parsed on top of gsm8k.yaml, run on tinymath on CPU
MEMORY_OVERLAYS = ["memory.yaml", "lora.yaml"]


def run(args: list[str], tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # logs and checkpoints go to tmp_path/runs
    return cli_run(args)


def one_step(model_dir: Path) -> list[str]:
    return [
        "--model.model", str(model_dir),
        "--trainer.max_steps", "1",
        "--trainer.val_check_interval", "1",
        "--trainer.enable_progress_bar", "false",
        "--data.batch_size", "2",
        "--data.num_train", "16",
        "--data.num_val", "4",
        "--data.val_batch_size", "4",
    ]  # fmt: skip


def test_every_config_is_listed():
    listed = {"tinymath.yaml", *PRESETS, *PARSE_ONLY, *OVERLAYS, *MEMORY_OVERLAYS}
    assert {c.name for c in CONFIGS} == listed


@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c.name not in PRESETS + MEMORY_OVERLAYS], ids=lambda c: c.name
)
def test_configs_parse(config, tmp_path, monkeypatch, capsys):
    base = OVERLAYS.get(config.name)
    files = [ROOT / "configs" / base, config] if base else [config]
    args = ["fit"] + [a for f in files for a in ("--config", str(f))] + ["--print_config"]
    with pytest.raises(SystemExit) as done:
        run(args, tmp_path, monkeypatch)
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    merged = {}
    for f in files:  # what the files say, later ones winning, must be what was parsed
        for section, values in yaml.safe_load(f.read_text()).items():
            if isinstance(values, dict):
                merged.setdefault(section, {}).update(values)
    assert printed["model"]["model"] == merged["model"]["model"]
    assert printed["data"]["source"] == merged["data"]["source"]
    assert printed["data"]["batch_size"] == merged["data"]["batch_size"]
    assert printed["trainer"]["devices"] == merged["trainer"]["devices"]
    assert "tokenizer" not in printed["data"], "data.tokenizer is linked to model.model"
    if base:  # an overlay changes only the keys it names
        strategy = printed["trainer"]["strategy"]
        assert strategy["class_path"].endswith("ModelParallelStrategy")
        assert strategy["init_args"]["tensor_parallel_size"] == 1
        assert strategy["init_args"]["data_parallel_size"] == merged["trainer"]["devices"]
        base_optimization = yaml.safe_load((ROOT / "configs" / base).read_text())["model"][
            "optimization"
        ]
        assert (
            printed["model"]["optimization"]["epochs_per_rollout"]
            == base_optimization["epochs_per_rollout"]
        )


def test_fsdp2_cpu_overlay_trains_with_two_processes(tmp_path, tiny_model_dir):
    """The overlay as a user runs it: Lightning starts the second process, both shard the
    model, the run finishes and writes a sharded checkpoint."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "lightning-troll"
    args = [str(script), "fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    args += ["--config", str(ROOT / "configs" / "fsdp2_cpu.yaml")] + one_step(tiny_model_dir)
    args += ["--model.optimization.minibatch_size", "8", "--trainer.max_steps", "2"]  # 2 steps
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning-troll: training finished" in done.stdout
    checkpoints = list(
        (tmp_path / "runs" / "lightning_troll" / "version_0" / "checkpoints").iterdir()
    )
    assert [c.name for c in checkpoints] == ["epoch=0-step=2.ckpt"]
    assert checkpoints[0].is_dir() and len(list(checkpoints[0].glob("*.distcp"))) == 2


@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_tinymath_and_presets_run_one_step(preset, tmp_path, monkeypatch, tiny_model_dir):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    if preset:
        args += ["--config", str(ROOT / "configs" / preset)]
    cli = run(args + one_step(tiny_model_dir), tmp_path, monkeypatch)
    assert cli.trainer.global_step == 1
    assert cli.datamodule.tokenizer.name_or_path == str(tiny_model_dir)  # linked to model.model
    module = cli.model
    assert isinstance(module.objective, TrollObjective)
    if preset:
        expected = yaml.safe_load((ROOT / "configs" / preset).read_text())["model"]
        assert module.estimator == expected["estimator"]
        assert module.objective.importance == expected["loss"]["importance"]
        assert module.objective.aggregation == expected["loss"]["aggregation"]
        assert module.dynamic_sampling == expected.get("dynamic_sampling", False)
        assert module.scale_rewards == expected.get("scale_rewards")
    assert (tmp_path / "runs" / "lightning_troll" / "version_0" / "config.yaml").exists()


def assert_contains(printed: dict, expected: dict, where: str = "model") -> None:
    """Every key of ``expected`` (recursively) has the same value in ``printed``."""
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_contains(printed[key], value, f"{where}.{key}")
        else:
            assert printed[key] == value, f"{where}.{key}"


@pytest.mark.parametrize("overlay", MEMORY_OVERLAYS)
def test_memory_overlays_parse_on_gsm8k_and_run_a_step_on_cpu(
    overlay, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    configs = ["--config", str(ROOT / "configs" / "gsm8k.yaml")]
    configs += ["--config", str(ROOT / "configs" / overlay)]
    with pytest.raises(SystemExit) as done:
        run(["fit", *configs, "--print_config"], tmp_path, monkeypatch)
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    expected = yaml.safe_load((ROOT / "configs" / overlay).read_text())["model"]
    assert_contains(printed, expected)

    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    args += ["--config", str(ROOT / "configs" / overlay)]
    cli = run(args + one_step(tiny_model_dir), tmp_path, monkeypatch)
    assert cli.trainer.global_step == 1
    module = cli.model
    assert (
        type(cli.trainer.optimizers[0]).__name__
        == expected["optimizer"]["class_path"].split(".")[-1]
    )
    kind = {"memory.yaml": "Int8Snapshot", "lora.yaml": "AdapterSnapshot"}[overlay]
    assert type(module.snapshot).__name__ == kind
    # bitsandbytes >= 0.48 runs its 8-bit optimisers on CPU (paged ones unpaged): tensors of >=
    # 4096 entries get 8-bit state, here the gate, up and down projections of both layers
    states = cli.trainer.optimizers[0].state.values()
    eight_bit = [s for s in states if s["state1"].dtype == torch.uint8]
    assert len(eight_bit) == {"memory.yaml": 6, "lora.yaml": 0}[overlay]
    assert len(states) == len([p for p in module.policy.parameters() if p.requires_grad])


def test_summary_reports_reward_by_quarter(tmp_path, monkeypatch, tiny_model_dir, capsys):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml")] + one_step(tiny_model_dir)
    cli = run(args + ["--trainer.max_steps", "8"], tmp_path, monkeypatch)
    rewards = next(c for c in cli.trainer.callbacks if hasattr(c, "mean_rewards")).mean_rewards
    assert len(rewards) == 8
    line = next(x for x in capsys.readouterr().out.splitlines() if "by quarter" in x)
    assert f"first {sum(rewards[:2]) / 2:.3f} -> last {sum(rewards[-2:]) / 2:.3f}" in line


def test_objective_switches_from_one_key(tmp_path, monkeypatch, tiny_model_dir):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--model.objective", "clip"]
    cli = run(args + one_step(tiny_model_dir), tmp_path, monkeypatch)
    assert isinstance(cli.model.objective, ClipObjective)
    assert cli.model.objective.eps_low == pytest.approx(0.2)
    assert "clip/active_frac" in cli.trainer.callback_metrics


def test_help_shows_documented_options(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(["fit", "--help"], tmp_path, monkeypatch)
    text = capsys.readouterr().out
    for option in (
        "--model.objective",
        "--model.trust_region.eps",
        "--model.estimator",
        "--rollout.log_samples",
        "--old_policy.every_n_rollouts",
        "--data.source",
        "--model.snapshot.dtype",
        "--model.lora.help",
        "--model.dynamic_sampling",
        "--model.dynamic_sampling_max_rounds",
        "--model.loss.mask_truncated",
        "--model.scale_rewards",
        "--model.reward_kwargs",
        "--model.trust_region.keep_sampled_token",
        "--data.val_samples",
    ):
        assert option in text, option
    assert "KL bound per token" in text  # a field docstring
    assert "per-row absmax" in text  # the snapshot's field docstring


def test_print_config_shows_the_peer_options_with_their_defaults(tmp_path, monkeypatch, capsys):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--print_config"]
    with pytest.raises(SystemExit) as done:
        run(args, tmp_path, monkeypatch)
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["dynamic_sampling"] is False and model["dynamic_sampling_max_rounds"] == 3
    assert model["scale_rewards"] is None and model["reward_kwargs"] is None
    assert model["loss"]["mask_truncated"] is False
    assert model["trust_region"]["keep_sampled_token"] is True
    assert printed["data"]["val_samples"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.estimator", "ppo"], "ppo"),
        (["--model.scale_rewards", "std"], "std"),
        (["--data.val_samples", "-1"], "val_samples"),
        (["--model.objective", "kl"], "kl"),
        (["--data.source", "missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_options_stop_before_training(
    args, message, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml")] + one_step(tiny_model_dir)
    with pytest.raises((SystemExit, ValueError)) as error:
        run(base + args, tmp_path, monkeypatch)
    text = str(error.value) + capsys.readouterr().err
    assert message in text
    assert not (tmp_path / "runs" / "lightning_troll" / "version_0" / "checkpoints").exists()


def test_console_script_exits_zero(tmp_path, tiny_model_dir):
    """`lightning-troll` as a user runs it: a subprocess, exit status 0, the summary printed."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "lightning-troll"
    args = [str(script), "fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    done = subprocess.run(
        args + one_step(tiny_model_dir), cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lightning-troll: training finished" in done.stdout
    assert "mean reward, by quarter" not in done.stdout  # one rollout: no quarters
    assert "tensorboard --logdir runs" in done.stdout
