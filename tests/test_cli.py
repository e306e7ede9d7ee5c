"""The lightning-troll command: every config parses, CPU configs run a step, help and errors."""

from __future__ import annotations

import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import yaml

from lightning_troll.cli.command import main as cli_main
from lightning_troll.cli.command import quarter_means, shows_help
from lightning_troll.cli.command import run as cli_run
from lightning_troll.objectives import ClipObjective, TrollObjective
from lightning_troll.tasks.rewards.registry import RewardError
from lightning_troll.training import policies as policies_file
from lightning_troll.training.module import TrollModule

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
# the 3-minute budget of `make demo`, on top of tinymath.yaml
DEMO = "demo.yaml"


def run(args: list[str], tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # logs and checkpoints go to tmp_path/runs
    return cli_run(args)


LOGS = Path("runs") / "lightning_logs" / "version_0"  # the default logger's folder, relative


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
        "--model.optimization.minibatch_size", "16",  # the rollout: 2 prompts x 8 completions
    ]  # fmt: skip


def test_every_config_is_listed():
    listed = {"tinymath.yaml", DEMO, *PRESETS, *PARSE_ONLY, *OVERLAYS, *MEMORY_OVERLAYS}
    assert {c.name for c in CONFIGS} == listed


@pytest.mark.parametrize(
    "config",
    [c for c in CONFIGS if c.name not in [*PRESETS, *MEMORY_OVERLAYS, DEMO]],
    ids=lambda c: c.name,
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


def test_the_demo_overlay_is_what_make_demo_runs(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """`make demo` runs tinymath.yaml with demo.yaml on top; the overlay's one-cycle schedule
    spans the run exactly, and a step of it trains with that scheduler."""
    makefile = (ROOT / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:") + 1 :].splitlines()[1].split()  # its recipe
    assert demo[1:] == ["fit", "--config", "configs/tinymath.yaml", "--config", "configs/demo.yaml"]
    configs = ["--config", str(ROOT / "configs" / "tinymath.yaml")]
    configs += ["--config", str(ROOT / "configs" / DEMO)]
    with pytest.raises(SystemExit) as done:
        run(["fit", *configs, "--print_config"], tmp_path, monkeypatch)
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    scheduler = printed["model"]["lr_scheduler"]
    assert scheduler["class_path"] == "torch.optim.lr_scheduler.OneCycleLR"
    assert scheduler["init_args"]["total_steps"] == printed["trainer"]["max_steps"] == 96
    assert printed["model"]["sampling"]["temperature"] == 0.7
    assert printed["model"]["trust_region"]["eps"] == 0.05  # tinymath.yaml's, kept
    assert printed["data"]["batch_size"] == 512
    cli = run(["fit", *configs, *one_step(tiny_model_dir)], tmp_path, monkeypatch)
    assert cli.trainer.global_step == 1
    (config,) = cli.trainer.lr_scheduler_configs
    assert type(config.scheduler).__name__ == "OneCycleLR" and config.scheduler.total_steps == 96


def test_fsdp2_cpu_overlay_trains_with_two_processes(tmp_path, tiny_model_dir):
    """The overlay as a user runs it: Lightning starts the second process, both shard the
    model, the run finishes and writes a sharded checkpoint, a folder saved after each of its 2
    rollouts and swapped in whole (nothing left beside it), which the command it prints resumes
    from (that a sharded checkpoint resumes exactly: tests/test_distributed.py)."""
    import subprocess
    import sys

    from lightning_troll.training.checkpoints import check_checkpoint_file

    script = Path(sys.executable).parent / "lightning-troll"
    args = [str(script), "fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    args += ["--config", str(ROOT / "configs" / "fsdp2_cpu.yaml")] + one_step(tiny_model_dir)
    args += ["--model.optimization.minibatch_size", "16", "--trainer.max_steps", "2"]
    args += ["--checkpoint.every_n_rollouts", "1"]  # 2 rollouts, each saved
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning-troll: training finished" in done.stdout
    checkpoints = list((tmp_path / LOGS / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["last.ckpt"]  # the default RolloutCheckpoint
    assert checkpoints[0].is_dir() and len(list(checkpoints[0].glob("*.distcp"))) == 2
    resume = next(line for line in done.stdout.splitlines() if "resume: the same command" in line)
    printed = tmp_path / resume.split("--ckpt_path ", 1)[1].strip()  # relative to the run's folder
    assert printed.resolve() == checkpoints[0].resolve()
    check_checkpoint_file(checkpoints[0])  # what the command checks of a --ckpt_path


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
        assert module.global_batch.estimator == expected["advantages"]["estimator"]
        assert module.objective.importance == expected["loss"]["importance"]
        assert module.objective.aggregation == expected["loss"]["aggregation"]
        assert module.dynamic_sampling.enabled == expected.get("dynamic_sampling", {}).get(
            "enabled", False
        )
        assert module.global_batch.scale_rewards == expected["advantages"].get("scale_rewards")
    assert (tmp_path / LOGS / "config.yaml").exists()


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
    first, second, third, last = (sum(rewards[i : i + 2]) / 2 for i in (0, 2, 4, 6))
    assert f"first {first:.3f} -> {second:.3f} -> {third:.3f} -> last {last:.3f}" in line
    assert line.endswith("(8 rollouts)")


@pytest.mark.parametrize(
    ("values", "means"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4]),
        ([1, 1, 2, 2, 3, 3, 4, 4], [1, 2, 3, 4]),
        ([1, 2, 4, 6, 9], [1, 2, 5, 9]),  # the middle quarters share the odd one: [2], [4, 6]
        ([0, 1, 2, 3, 4, 5, 6], [0, 1.5, 4, 6]),  # [0], [1, 2], [3, 4, 5], [6]
    ],
)
def test_quarter_means(values, means):
    assert quarter_means(values) == pytest.approx(means, abs=1e-12)


def test_quarter_means_needs_four_values():
    with pytest.raises(ValueError, match="at least 4 values; got 3"):
        quarter_means([1.0, 2.0, 3.0])


def test_objective_switches_from_one_key(tmp_path, monkeypatch, tiny_model_dir):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--model.objective", "clip"]
    cli = run(args + one_step(tiny_model_dir), tmp_path, monkeypatch)
    assert isinstance(cli.model.objective, ClipObjective)
    assert cli.model.objective.eps_low == pytest.approx(0.2)
    assert "clip/active_frac" in cli.trainer.callback_metrics


@pytest.mark.parametrize("spelling", ["reward_options", "flat keys"])
def test_reward_options_in_a_config_file_reach_the_scorer(
    spelling, tmp_path, monkeypatch, tiny_model_dir
):
    """``model.reward_options`` in a YAML file reaches the scorer, and the checkpoint stores it;
    the flat keys of 0.1 it replaced do the same, folded with one warning naming the new places."""
    options = {"kwargs": None, "on_error": 0.0, "workers": 1, "timeout": 30.0}
    flat = {"on_reward_error": 0.0, "reward_workers": 1, "reward_timeout": 30.0}
    model = {"reward_options": options} if spelling == "reward_options" else flat
    config = tmp_path / "rewards.yaml"
    config.write_text(yaml.safe_dump({"model": model}))
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--config", str(config)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = run([*args, *one_step(tiny_model_dir)], tmp_path, monkeypatch)
    renamed = [str(w.message) for w in caught if "renamed in 0.2.0" in str(w.message)]
    assert len(renamed) == (spelling == "flat keys")
    if renamed:
        assert "model.reward_workers -> model.reward_options.workers" in renamed[0]
    scorer = cli.model.scorer
    assert (scorer.workers.count, scorer.workers.timeout) == (1, 30.0)
    assert scorer.policies == {"tinymath": 0.0}
    last = tmp_path / LOGS / "checkpoints" / "last.ckpt"
    stored = torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert stored["reward_options"] == options and not set(flat) & set(stored)


def test_help_shows_documented_options(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(["fit", "--help"], tmp_path, monkeypatch)
    text = capsys.readouterr().out
    for option in (
        "--model.objective",
        "--model.trust_region.eps",
        "--model.advantages.estimator",
        "--rollout.log_samples",
        "--old_policy.every_n_rollouts",
        "--data.source",
        "--model.snapshot.dtype",
        "--model.lora.help",
        "--model.dynamic_sampling.enabled",
        "--model.dynamic_sampling.max_rounds",
        "--model.corrections.mask_truncated",
        "--model.advantages.scale_rewards",
        "--model.reward_options.kwargs",
        "--model.reward_options.timeout",
        "--model.trust_region.keep_sampled_token",
        "--data.val_samples",
    ):
        assert option in text, option
    assert "KL bound per token" in text  # a field docstring
    assert "per-row absmax" in text  # the snapshot's field docstring


@pytest.mark.parametrize(
    ("args", "shows"),
    [
        (["fit", "--config", "c.yaml"], False),
        (["fit", "--model.objective", "clip", "--trainer.max_steps", "2"], False),
        (["fit", "--help"], True),
        (["-h"], True),
        (["fit", "--model.lora.help", "LoraConfig"], True),
        (["fit", "--model.optimizer.help=torch.optim.AdamW"], True),
        (["fit", "--config", "c.yaml", "--print_config"], True),
        (["fit", "--print_config=comments"], True),
    ],
)
def test_shows_help(args, shows):
    assert shows_help(args) is shows


def test_field_docstrings_are_read_only_for_help(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """Field docstrings come from parsing the source of every class the parser covers (seconds
    per start): a run reads none of them, ``--help`` still shows them."""
    import docstring_parser

    calls = []
    real = docstring_parser.parse_from_object

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(docstring_parser, "parse_from_object", counted)
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    status, err = main_exit(
        args + ["--model.trust_region.eps", "-1"], tmp_path, monkeypatch, capsys
    )
    assert status == 2 and "eps must be a finite number > 0" in err  # parsed, then refused
    assert calls == []
    with pytest.raises(SystemExit):
        run(["fit", "--help"], tmp_path, monkeypatch)
    assert calls
    assert "KL bound per token" in capsys.readouterr().out


def test_print_config_shows_the_peer_options_with_their_defaults(tmp_path, monkeypatch, capsys):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--print_config"]
    with pytest.raises(SystemExit) as done:
        run(args, tmp_path, monkeypatch)
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["dynamic_sampling"] == {"enabled": False, "max_rounds": 3}
    assert (
        model["advantages"]["scale_rewards"] is None and model["reward_options"]["kwargs"] is None
    )
    assert model["corrections"]["mask_truncated"] is False and "mask_truncated" not in model["loss"]
    assert model["trust_region"]["keep_sampled_token"] is True
    assert printed["data"]["val_samples"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.advantages.estimator", "ppo"], "ppo"),
        (["--model.advantages.scale_rewards", "std"], "std"),
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
    assert not (tmp_path / LOGS / "checkpoints").exists()


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


# -- logs and checkpoints where Lightning puts them ----------------------------------------------
def saved_steps(monkeypatch) -> list[tuple[str, int]]:
    """(file name, global step) of every checkpoint written (RolloutCheckpoint's atomic save)."""
    from lightning_troll.training.checkpoint_io import AtomicCheckpointIO

    saved, save = [], AtomicCheckpointIO.save_checkpoint

    def spy(self, checkpoint, path, storage_options=None):
        saved.append((Path(path).name, checkpoint["global_step"]))
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", spy)
    return saved


def test_logs_and_checkpoints_follow_default_root_dir(tmp_path, monkeypatch, tiny_model_dir):
    """Lightning's rule: the default (TensorBoard) logger and the default checkpoint both live
    under --trainer.default_root_dir; nothing is written to ./runs."""
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--trainer.default_root_dir", "elsewhere", "--trainer.max_steps", "2"]
    cli = run(args, tmp_path, monkeypatch)
    logs = tmp_path / "elsewhere" / "lightning_logs" / "version_0"
    assert type(cli.trainer.logger).__name__ == "TensorBoardLogger"
    assert Path(cli.trainer.logger.log_dir).resolve() == logs
    assert list(logs.glob("events.out.tfevents.*")) and (logs / "config.yaml").exists()
    last = logs / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 2
    assert not (tmp_path / "runs").exists()

    # loading the command line's checkpoint in Python: its stored options (dicts) equal the
    # records the module rebuilds from them, so nothing is reported as changed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = TrollModule.load_from_checkpoint(last)
    assert [str(w.message) for w in caught if "other options" in str(w.message)] == []
    assert loaded.hparams.trust_region.eps == cli.model.hparams.trust_region["eps"]


def test_default_checkpoint_every_n_rollouts_at_the_end_and_resumed_in_one_line(
    tmp_path, monkeypatch, tiny_model_dir, capsys
):
    """A 5-rollout run with no checkpoint configured writes last.ckpt after rollouts 2 and 4
    (every_n_rollouts) and 5 (the end), one optimiser step per rollout; the printed resume line
    continues it."""
    saved = saved_steps(monkeypatch)
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--trainer.val_check_interval", "2", "--checkpoint.every_n_rollouts", "2"]
    cli = run([*args, "--trainer.max_steps", "5"], tmp_path, monkeypatch)
    assert saved == [("last.ckpt", 2), ("last.ckpt", 4), ("last.ckpt", 5)]
    last = tmp_path / LOGS / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no temporary files
    assert cli.checkpoint_callback.last_model_path == str(LOGS / "checkpoints" / "last.ckpt")
    out = capsys.readouterr().out
    resume = next(line for line in out.splitlines() if "resume:" in line)
    assert resume.endswith(f"--ckpt_path {cli.checkpoint_callback.last_model_path}")

    saved.clear()
    resumed = run(
        [*args, "--trainer.max_steps", "7", "--ckpt_path", str(last)], tmp_path, monkeypatch
    )
    assert resumed.trainer.global_step == 7
    assert saved == [("last.ckpt", 6), ("last.ckpt", 7)]  # rollouts 6 (every 2) and 7 (the end)
    new_last = tmp_path / "runs" / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(new_last, map_location="cpu", weights_only=True)["global_step"] == 7


def test_no_default_checkpoint_when_checkpointing_is_off_or_one_is_given(
    tmp_path, monkeypatch, tiny_model_dir
):
    saved = saved_steps(monkeypatch)
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    cli = run([*args, "--trainer.enable_checkpointing", "false"], tmp_path, monkeypatch)
    assert cli.checkpoint_callback is None and saved == []
    own = '{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "mine"}}'
    with pytest.warns(UserWarning, match=r"replaces RolloutCheckpoint: only your callback's"):
        cli = run([*args, "--trainer.callbacks", own], tmp_path, monkeypatch)
    assert cli.checkpoint_callback is None
    assert [name for name, _ in saved] == ["epoch=0-step=1.ckpt"]  # the given one's, only
    saved.clear()  # both listed: no warning, and each saves
    ours = '{"class_path": "lightning_troll.callbacks.RolloutCheckpoint"}'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = run([*args, "--trainer.callbacks+", own, "--trainer.callbacks+", ours], tmp_path,
                  monkeypatch)  # fmt: skip
    assert not [w for w in caught if "replaces RolloutCheckpoint" in str(w.message)]
    assert cli.checkpoint_callback is not None
    names = sorted(name for name, _ in saved)  # the first run's file is in "mine" already
    assert names == ["epoch=0-step=1-v1.ckpt", "last.ckpt"]


# -- bad input: one line and exit status 2; crashes keep their traceback -------------------------
def main_exit(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str]:
    """Runs ``main`` as the console script does; returns its exit status and stderr."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli_main(args)
    return exited.value.code, capsys.readouterr().err


def test_a_true_false_or_choice_option_names_every_allowed_value(tmp_path, monkeypatch, capsys):
    """An option typed ``bool | Literal['auto']`` refuses a value by naming true and false too."""
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    status, err = main_exit(
        args + ["--model.trust_region.compile_solver", "maybe"], tmp_path, monkeypatch, capsys
    )
    assert status == 2
    assert (
        "lightning-troll: error: model.trust_region.compile_solver: 'maybe' is not allowed; "
        "choose one of true, false, auto\n" in err
    )


def broken_jsonl(tmp_path: Path) -> str:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--model.trust_region.eps", "-1"],
                     "model.trust_region.eps must be a finite number > 0 (the KL bound); got -1.0",
                     id="option"),
        pytest.param(["--data.source", "missing.jsonl"], "data.source: file 'missing.jsonl'",
                     id="missing-file"),
        pytest.param(["--data.source", broken_jsonl], "broken.jsonl', line 2: not valid JSON",
                     id="broken-json-line"),
        pytest.param(["--ckpt_path", "gone.ckpt"], "--ckpt_path 'gone.ckpt': no such file",
                     id="missing-checkpoint"),
        pytest.param(["--ckpt_path", "last"], "--ckpt_path last: no ModelCheckpoint is "
                     "configured to look it up in, so the run would start afresh; give the path",
                     id="last-without-model-checkpoint"),
        pytest.param(["--model.engine.name", "vllm"], "make setup-vllm", id="engine-missing",
                     marks=pytest.mark.skipif(find_spec("vllm") is not None,
                                              reason="vLLM is installed here")),
        pytest.param(["--model.engine.name", "sglang"], "model.engine.name must be one of "
                     "['hf', 'vllm', 'vllm_server'] or an import path", id="unknown-engine"),
        pytest.param(["--config", str(ROOT / "configs" / "demo.yaml"), "--trainer.max_steps",
                      "200"], "model.lr_scheduler.init_args.total_steps=96 is smaller than "
                     "trainer.max_steps=200: OneCycleLR schedules 96 optimiser steps",
                     id="schedule-shorter-than-run"),
        pytest.param(["--config", str(ROOT / "configs" / "demo.yaml"), "--trainer.max_steps",
                      "-1"], "trainer.max_steps=-1 (no limit)", id="schedule-without-limit"),
        pytest.param(["--trainer.max_steps", "0"], "trainer.max_steps=0: the run would train "
                     "nothing; give a positive number, or -1 (no limit)", id="no-steps"),
        pytest.param(["--trainer.max_epochs", "0"], "trainer.max_epochs=0: the run would train "
                     "nothing", id="no-epochs"),
        pytest.param(["--trainer.enable_checkpointing", "false", "--trainer.callbacks",
                      "lightning.pytorch.callbacks.ModelCheckpoint"],
                     "enable_checkpointing=False", id="lightning-check"),
        pytest.param(["--model.optimizer.init_args.lr", "-1"], "model.optimizer.init_args "
                     "(torch.optim.AdamW): Invalid learning rate: -1.0", id="negative-lr"),
        pytest.param(["--model.lr_scheduler", '{"class_path": "torch.optim.lr_scheduler.'
                      'CosineAnnealingLR", "init_args": {"T_max": 0}}'],
                     "model.lr_scheduler.init_args (torch.optim.lr_scheduler.CosineAnnealingLR): "
                     "the schedule divides by zero at optimiser step 1; a period or a length of 0",
                     id="schedule-of-no-length"),
        pytest.param(["--model.lr_scheduler", '{"class_path": "torch.optim.lr_scheduler.'
                      'ExponentialLR", "init_args": {"gamma": -0.5}}'],
                     "(torch.optim.lr_scheduler.ExponentialLR): the learning rate is -5e-05 after "
                     "1 optimiser step(s); it must stay a finite number >= 0",
                     id="negative-schedule"),
        pytest.param(["--model.optimization.minibatch_size", "12"],
                     "model.optimization.minibatch_size=12 does not divide a rollout of 16 "
                     "sequences (data.batch_size=2 x model.group_size=8): 1 step of 12 sequences "
                     "would leave a last one of 4; choose one of [1, 2, 4, 8, 16]", id="minibatch-not-a-divisor"),
        pytest.param(["--data.batch_size", "0"], "data.batch_size must be an integer >= 1",
                     id="no-prompts"),
        pytest.param(["--data.source", lambda tmp: str(tmp)], "is a folder, not a file",
                     id="folder-as-data"),
        pytest.param(["--old_policy.max_staleness", "-1"],
                     "old_policy.max_staleness must be an integer >= 0; got -1", id="staleness"),
        pytest.param(["--old_policy.every_n_rollouts", "2", "--model.snapshot.mode", "shared"],
                     "old_policy.every_n_rollouts=2 needs a snapshot that can lag",
                     id="lag-on-shared"),
        pytest.param(["--data.val_batch_size", "0"],
                     "data.val_batch_size must be an integer >= 1; got 0", id="data-option"),
        pytest.param(["--data.template", "{prompt"],
                     "data.template='{prompt' is not a valid format string", id="data-template"),
        pytest.param(["--rollout.log_samples", "-1"],
                     "rollout.log_samples must be an integer >= 0; got -1", id="callback-option"),
        pytest.param(["--trust_region_monitor.histogram_every_n_rollouts", "-1"],
                     "trust_region_monitor.histogram_every_n_rollouts must be an integer >= 0",
                     id="monitor-option"),
        pytest.param(["--old_policy.max_staleness", "2", "--model.snapshot.dtype", "int8"],
                     "old_policy.max_staleness=2 keeps past versions of the weights",
                     id="staleness-on-int8"),
        pytest.param(["--model.trust_region.support", "dense", "--model.corrections.anchor", "proximal"],
                     "model.corrections.anchor='proximal' does not work with "
                     "model.trust_region.support='dense'", id="proximal-on-dense"),
        pytest.param(["--old_policy.max_staleness", "1", "--trainer.devices", "2"],
                     "old_policy.max_staleness=1 runs in one process for now; this run has 2",
                     id="staleness-on-two-processes"),
        pytest.param(["--model.engine.options", "{process: true}", "--trainer.devices", "2"],
                     "model.engine.name='hf' with model.engine.options.process true runs in a "
                     "single process; this run has 2", id="engine-process-on-two-processes"),
        pytest.param(["--model.engine.options", "{threads: 2}"],
                     "model.engine.options.threads=2 sets the threads of the engine's own process: "
                     "it needs model.engine.options.process: true", id="threads-without-process"),
        pytest.param(["--model.engine.name", "vllm_server", "--model.engine.options",
                      "{servers: http://127.0.0.1:1}"],
                     "model.engine.options.servers must be null or a list of addresses",
                     id="servers-not-a-list"),
        pytest.param(["--model.engine.name", "vllm_server", "--model.engine.options",
                      "{servers: [http://127.0.0.1:1]}"],
                     "model.engine.options.servers: the vLLM server at http://127.0.0.1:1 did not "
                     "answer GET /v1/models", id="server-not-answering"),
        pytest.param(["--model.corrections.anchor_is_cap", "1e400"],
                     "model.corrections.anchor_is_cap must be a finite number >= 1; got inf", id="infinite-cap"),
        pytest.param(["--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger",
                      "--trainer.logger.tracking_uri", "file:./mlruns"],
                     "lightning.pytorch.loggers.MLFlowLogger refused its arguments: MlflowException:"
                     " The filesystem tracking backend", id="logger-refuses",
                     marks=pytest.mark.skipif(find_spec("mlflow") is None, reason="no mlflow")),
    ],
)  # fmt: skip
def test_bad_input_prints_one_line_and_exits_2(
    args, message, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    args = [a(tmp_path) if callable(a) else a for a in args]
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    configs = args[:2] if args[:1] == ["--config"] else []  # before the options, as a user's
    args = args[len(configs) :]
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *configs]
    base += one_step(tiny_model_dir)
    loaded = []
    real_load = policies_file.load_policy
    monkeypatch.setattr(
        policies_file, "load_policy", lambda *a, **k: loaded.append(a) or real_load(*a, **k)
    )
    status, err = main_exit(base + args, tmp_path, monkeypatch, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("lightning-troll: error: ") and message in lines[-1]
    assert len([line for line in lines if not line.startswith("Seed set to")]) <= 3
    assert "Traceback" not in err
    assert not loaded, "the model was loaded before the input was refused"
    assert not (tmp_path / "runs").exists()  # no run folder either


@pytest.mark.parametrize(
    "lr", [["--model.optimizer.init_args.lr", "3e-4"], ["--model.optimizer.lr", "3e-4"]]
)
def test_the_learning_rate_is_set_from_the_command_line_without_naming_a_class(
    lr, tmp_path, monkeypatch, capsys
):
    """No config names an optimiser: the default (AdamW at 1e-6) takes the learning rate the way
    a Lightning user tries first."""
    with pytest.raises(SystemExit):
        run(["fit", *lr, "--print_config"], tmp_path, monkeypatch)
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["optimizer"]
    assert printed["class_path"] == "torch.optim.AdamW" and printed["init_args"]["lr"] == 3e-4


def test_debug_brings_the_traceback_back(tmp_path, monkeypatch, tiny_model_dir):
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--model.trust_region.eps", "-1"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        cli_main(["--debug", *args])
    monkeypatch.setenv("LIGHTNING_TROLL_DEBUG", "1")
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        cli_main(args)


def test_a_reward_that_raises_in_training_stops_with_status_3_or_a_traceback_on_debug(
    tmp_path, monkeypatch, tiny_model_dir, capsys
):
    """A reward function that raises in the first rollout stops the run: the failure on one
    line, the checkpoint saved before the rollout on the next, exit status 3. With --debug the
    RewardError (a RewardFault) comes through with its traceback."""
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--model.rewards", '{"tests.reward_helpers:raises": 1.0}']
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 3
    err = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith(("light", "  "))
    ]
    assert err[0].startswith(
        "lightning-troll: stopped: reward function 'tests.reward_helpers:raises'"
    )
    assert "raised KeyError" in err[0] and err[1].startswith("  saved ") and len(err) == 2
    with pytest.raises(RewardError, match="raised KeyError") as error:
        cli_main([*args, "--debug"])
    assert error.value.resumable


def test_the_command_reports_a_folder_that_is_not_a_model(tmp_path, monkeypatch, capsys):
    """As a user sees it (the command's main, here): one line on stderr naming the folder and
    what it lacks, status 2."""
    from tests.conftest import refused_here

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a model")
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--model.model", "notes"]
    stderr = refused_here(args, tmp_path, monkeypatch, capsys)
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"lightning-troll: error: 'notes' is not a model folder: {tmp_path / 'notes'} has no "
        "config.json and no tokenizer (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json, *.model). A model folder holds what save_pretrained "
        "writes for a causal LM and its tokenizer: config.json, the weights "
        "(model.safetensors or pytorch_model.bin, or shards with their index) and the tokenizer "
        "files (tokenizer.json and tokenizer_config.json, or a tokenizer.model); give such a "
        "folder, a hub id, a .gguf file, or 'tinymath'"
    )


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path, tiny_model_dir, capsys):
    """A copy of the tiny model whose model.safetensors lost its second half: one line, status
    2, the file named."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "tinymath.yaml"),
        "--model.model",
        str(broken),
    ]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        f"lightning-troll: error: model: the weights in {weights} cannot be read"
    )
    assert "truncated or corrupt" in last


def test_console_script_stopped_by_sigterm_saves_and_exits_143(tmp_path, tiny_model_dir):
    """SIGTERM (a scheduler's stop) to a real process: the rollout in progress finishes,
    last.ckpt is written whole, the summary says so and names it, and the status is 128 + 15."""
    import signal
    import subprocess
    import sys
    import time

    from lightning_troll.training.checkpoints import check_checkpoint_file

    script = Path(sys.executable).parent / "lightning-troll"
    args = [str(script), "fit", "--config", str(ROOT / "configs" / "tinymath.yaml")]
    args += one_step(tiny_model_dir) + ["--trainer.max_steps", "100000"]
    args += ["--trainer.limit_val_batches", "0", "--checkpoint.every_n_rollouts", "1"]
    last = tmp_path / LOGS / "checkpoints" / "last.ckpt"
    process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not last.exists():
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    check_checkpoint_file(last)
    steps = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert steps >= 1
    assert "SIGTERM received" in err.decode() + out.decode()
    summary = out.decode()[out.decode().index("lightning-troll: stopped by SIGTERM") :]
    last_path = LOGS / "checkpoints" / "last.ckpt"
    assert f"resume: the same command with --ckpt_path {last_path}" in summary
    assert f"export: lightning-troll export --ckpt_path {last_path} --output_dir" in summary


def test_ckpt_path_last_is_left_to_lightning_where_a_model_checkpoint_looks_it_up():
    from jsonargparse import Namespace

    from lightning_troll.cli.checks import check_named_checkpoint

    def config(*class_paths: str) -> Namespace:
        return Namespace(
            trainer=Namespace(callbacks=[Namespace(class_path=c) for c in class_paths])
        )

    check_named_checkpoint(config("lightning.pytorch.callbacks.ModelCheckpoint"), "last")
    check_named_checkpoint(config(), "runs/x/last.ckpt")  # a path: checked as a file elsewhere
    with pytest.raises(ValueError, match=r"^--ckpt_path best: no ModelCheckpoint is configured"):
        check_named_checkpoint(config("lightning.pytorch.callbacks.EarlyStopping"), "best")


def _optimizer_config(lr: float, scheduler: dict | None, max_steps: int):
    from jsonargparse import Namespace

    optimizer = Namespace(class_path="torch.optim.AdamW", init_args=Namespace(lr=lr))
    lr_scheduler = None if scheduler is None else Namespace(**scheduler)
    model = Namespace(optimizer=optimizer, lr_scheduler=lr_scheduler)
    return Namespace(model=model, trainer=Namespace(max_steps=max_steps))


def test_a_learning_rate_of_0_warns_that_the_run_trains_nothing():
    from lightning_troll.cli.checks import check_optimizer

    with pytest.warns(UserWarning, match=r"model.optimizer.init_args.lr=0 \(torch.optim.AdamW\)"):
        check_optimizer(_optimizer_config(0.0, None, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizer(_optimizer_config(1e-6, None, 10))


def test_a_schedule_is_stepped_as_far_as_the_run_goes_and_no_further():
    """The schedule is stepped min(2, trainer.max_steps) times: StepLR with step_size 0 fails at
    its first; a OneCycleLR of one step passes a run of one step and fails a longer one (the same
    error the run would meet); ReduceLROnPlateau, which steps on a metric, is only built."""
    from lightning_troll.cli.checks import check_optimizer

    step_size_0 = {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 0}}
    with pytest.raises(ValueError, match=r"StepLR\): the schedule divides by zero at optimiser"):
        check_optimizer(_optimizer_config(1e-4, step_size_0, -1))
    one_cycle = {
        "class_path": "torch.optim.lr_scheduler.OneCycleLR",
        "init_args": {"max_lr": 1e-4, "total_steps": 1},
    }
    check_optimizer(_optimizer_config(1e-4, one_cycle, 1))  # one step: within its length
    with pytest.raises(ValueError, match=r"OneCycleLR\): Tried to step 2 times"):
        check_optimizer(_optimizer_config(1e-4, one_cycle, 5))
    plateau = {"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau", "init_args": {}}
    check_optimizer(_optimizer_config(1e-4, plateau, 5))  # steps on a metric: built, not stepped


def test_a_resumed_run_keeps_the_data_seed_of_its_checkpoint(
    tmp_path, monkeypatch, tiny_model_dir, recwarn
):
    """A run with ``seed_everything: 3`` resumed with ``seed_everything: 4`` (a config changed
    in between): its model options, ``model.optimization.seed`` among them, come from the checkpoint, and so
    does an unset ``data.seed``, so the rows held out of the file are the first start's (before,
    the new seed held out other rows, some of them the first start's training rows, and warned
    only that the order differed). A ``data.seed`` given on the command line is kept."""
    import json

    data = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(1, 25)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--data.source", str(data), "--data.num_val", "4", "--data.num_train", "null"]
    first = run([*args, "--seed_everything", "3"], tmp_path, monkeypatch)
    last = tmp_path / LOGS / "checkpoints" / "last.ckpt"
    resume = [*args, "--seed_everything", "4", "--trainer.max_steps", "2", "--ckpt_path", str(last)]
    resumed = run(resume, tmp_path, monkeypatch)
    assert resumed.trainer.global_step == 2
    assert first.datamodule.seed == resumed.datamodule.seed == 3
    held_out = [item.row["prompt"] for item in first.datamodule.val_items]
    assert [item.row["prompt"] for item in resumed.datamodule.val_items] == held_out
    assert not [w for w in recwarn if "differs from the checkpoint" in str(w.message)]
    given = run([*resume[:-4], "--data.seed", "5", *resume[-4:]], tmp_path, monkeypatch)
    assert given.datamodule.seed == 5
    assert [w for w in recwarn if "data.seed=5 differs from the checkpoint's 3" in str(w.message)]
