"""Bad checkpoints, models, tokenizers and weights: each a clear error before training."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from lightning_troll.cli.command import run as cli_run
from lightning_troll.engines.sampling import SamplingConfig, sample
from lightning_troll.models.loading import load_policy, load_tokenizer, tiny_causal_lm
from lightning_troll.models.tinymath import build_tokenizer
from lightning_troll.objectives import ClipObjective, TrollObjective
from lightning_troll.training.checkpoints import (
    CheckpointError,
    check_checkpoint_file,
    check_compatible,
)
from lightning_troll.training.module import LossConfig
from tests.test_training import make_data, make_module, make_trainer

ROOT = Path(__file__).resolve().parents[1]


def fit_args(workdir: Path, model_dir: Path, max_steps: int, *extra: str) -> list[str]:
    """A CLI fit of a tiny model saving ``workdir/ckpt/last.ckpt`` at every rollout."""
    config = {
        "trainer": {
            "max_steps": max_steps,
            "default_root_dir": str(workdir),  # where config.yaml goes without a logger
            "enable_progress_bar": False,
            "limit_val_batches": 0,
            "logger": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(workdir / "ckpt"), "save_last": True},
                }
            ],
        },
        "model": {
            "model": str(model_dir),
            "group_size": 2,
            "sampling": {"max_new_tokens": 2},
            "optimization": {"minibatch_size": 4},  # the rollout: 2 prompts x 2 completions
        },
        "data": {"batch_size": 2, "num_train": 8, "num_val": 0},
    }
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), "--config", str(path)] + [
        *extra
    ]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir) -> Path:
    """A TROLL run's checkpoint after one rollout."""
    workdir = tmp_path_factory.mktemp("written")
    cli_run(fit_args(workdir, tiny_model_dir, 1))
    return workdir / "ckpt" / "last.ckpt"


def other_model(path: Path, **sizes) -> Path:
    tokenizer = build_tokenizer()
    options = {"vocab_size": len(tokenizer), "pad_token_id": 0, "eos_token_id": 2, **sizes}
    tiny_causal_lm(**options).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- checkpoints ---------------------------------------------------------------------------------
def corrupt(data: bytes, how: str) -> bytes:
    if how == "truncated":  # a save cut off half-way
        return data[: len(data) // 2]
    if how == "garbage":
        return torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0))
    if how == "flipped":  # bytes overwritten inside a stored tensor
        middle = len(data) // 2
        return (
            data[:middle]
            + bytes(b ^ 0xFF for b in data[middle : middle + 64])
            + data[middle + 64 :]
        )
    raise AssertionError(how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbage", "flipped", "missing"])
def test_an_unreadable_checkpoint_is_refused_naming_its_path(how, checkpoint, tmp_path):
    bad = tmp_path / "bad.ckpt"
    if how != "missing":
        data = corrupt(checkpoint.read_bytes(), how)
        bad.write_bytes(bytes(data.tolist()) if isinstance(data, torch.Tensor) else data)
    message = "no such file" if how == "missing" else "(not a readable checkpoint|is corrupt)"
    with pytest.raises(CheckpointError, match=rf"--ckpt_path '{bad}'.*{message}"):
        check_checkpoint_file(bad)
    check_checkpoint_file(checkpoint)  # the original passes


@pytest.mark.slow
def test_the_cli_refuses_an_unreadable_checkpoint_before_training(
    checkpoint, tmp_path, tiny_model_dir
):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(corrupt(checkpoint.read_bytes(), "truncated"))
    before = digest(bad)
    with pytest.raises(CheckpointError, match=rf"--ckpt_path '{bad}' is not a readable checkpoint"):
        cli_run(fit_args(tmp_path, tiny_model_dir, 2, "--ckpt_path", str(bad)))
    assert not (tmp_path / "ckpt").exists(), "nothing trained, nothing saved"
    assert digest(bad) == before


def resume(tmp_path: Path, module, checkpoint: Path):
    trainer = make_trainer(tmp_path, 2, limit_val_batches=0)
    trainer.fit(module, datamodule=make_data(module.hparams.model), ckpt_path=checkpoint)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 22}, r"policy.model.embed_tokens.weight has shape \(17, 32\) in the "
         r"checkpoint but \(22, 32\)"),
        ({"hidden_size": 16}, r"policy.model.embed_tokens.weight has shape \(17, 32\) in the "
         r"checkpoint but \(17, 16\)"),
        ({"num_layers": 3}, r"18 tensors are missing from it \(first: policy.model.layers.2"),
    ],
)  # fmt: skip
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(
    change, message, checkpoint, tmp_path
):
    module = make_module(other_model(tmp_path / "other", **change))
    before = digest(checkpoint)
    with pytest.raises(CheckpointError, match=message):
        resume(tmp_path, module, checkpoint)
    assert digest(checkpoint) == before
    assert not list(tmp_path.rglob("*.ckpt")), "no checkpoint written"


@pytest.mark.slow
def test_a_reference_policy_the_checkpoint_lacks_is_refused(checkpoint, tmp_path, tiny_model_dir):
    module = make_module(tiny_model_dir, loss=LossConfig(ref_kl_coef=0.1))
    with pytest.raises(
        CheckpointError, match=r"missing from it \(first: ref_policy\..*ref_kl_coef"
    ):
        resume(tmp_path, module, checkpoint)


@pytest.mark.slow
def test_a_troll_checkpoint_resumes_as_clip_with_a_warning(checkpoint, tmp_path, tiny_model_dir):
    """Both objectives train the same weights from the same snapshot: switching is allowed."""
    module = make_module(tiny_model_dir, objective="clip")
    with pytest.warns(UserWarning, match=r"model.objective: 'troll' -> 'clip'"):
        trainer = resume(tmp_path, module, checkpoint)
    assert trainer.global_step == 2 and isinstance(module.objective, ClipObjective)
    assert "clip/approx_kl" in trainer.callback_metrics


@pytest.mark.slow
def test_the_cli_resumes_with_the_checkpoints_options_and_says_so(
    checkpoint, tmp_path, monkeypatch
):
    """LightningCLI replaces the model options by those stored in the checkpoint."""
    args = fit_args(tmp_path, Path("elsewhere"), 2, "--ckpt_path", str(checkpoint))
    ignored = r"ignored: model.model: .* -> 'elsewhere'.*model.objective: 'troll' -> 'clip'"
    with pytest.warns(UserWarning, match=ignored):
        cli = cli_run(args + ["--model.objective", "clip"])
    assert cli.trainer.global_step == 2 and isinstance(cli.model.objective, TrollObjective)


def test_check_compatible_accepts_the_same_model():
    state = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_compatible(state, {k: v.clone() for k, v in state.items()})
    with pytest.raises(CheckpointError, match=r"it has 1 tensors the model lacks \(first: c\)"):
        check_compatible(state, {**state, "c": torch.zeros(1)})


# -- tokenizers, models and weights --------------------------------------------------------------
def saved_tokenizer(path: Path, pad: bool, eos: bool) -> Path:
    tokenizer = build_tokenizer()
    if not pad:
        tokenizer.pad_token = None
    if not eos:
        tokenizer.eos_token = None
    tokenizer.save_pretrained(path)
    return path


def test_a_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    path = saved_tokenizer(tmp_path, pad=False, eos=True)
    with pytest.warns(UserWarning, match=r"has no pad token; using its eos token '<eos>' \(id 2\)"):
        tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2


def test_a_tokenizer_without_pad_and_eos_tokens_is_refused(tmp_path):
    path = saved_tokenizer(tmp_path, pad=False, eos=False)
    with pytest.raises(ValueError, match=r"has neither a pad token nor an eos token"):
        load_tokenizer(path)


def test_a_folder_that_is_not_a_model_is_named_with_what_it_lacks(tmp_path, tiny_model_dir):
    """Not a sentencepiece or tiktoken error from deep inside transformers: the folder, what it
    lacks (config.json, a tokenizer) and what a model folder holds."""
    empty = tmp_path / "notes"
    empty.mkdir()
    (empty / "README.md").write_text("notes, not a model")
    lacks_both = re.escape(f"'{empty}' is not a model folder: {empty} has no config.json and no")
    with pytest.raises(FileNotFoundError, match=lacks_both + r".*A model folder holds"):
        load_tokenizer(empty)
    with pytest.raises(FileNotFoundError, match=lacks_both):
        load_policy(empty)
    with pytest.raises(FileNotFoundError, match=lacks_both):
        make_module(empty)

    no_tokenizer = tmp_path / "weights_only"  # what model.save_pretrained alone writes
    shutil.copytree(tiny_model_dir, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(FileNotFoundError, match=r"weights_only has no tokenizer \(none of"):
        load_tokenizer(no_tokenizer)
    assert load_policy(no_tokenizer).config.vocab_size == 17  # the model alone needs no tokenizer

    no_config = tmp_path / "tokenizer_only"  # what tokenizer.save_pretrained alone writes
    build_tokenizer().save_pretrained(no_config)
    with pytest.raises(FileNotFoundError, match=r"tokenizer_only has no config.json\. A model"):
        load_policy(no_config)
    assert len(load_tokenizer(no_config)) == 17  # the tokenizer alone needs no model config


def test_a_policy_without_generation_config_samples_with_defaults(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").unlink()
    policy = load_policy(tmp_path)
    assert policy.generation_config.eos_token_id == 2
    policy.generation_config = None  # a model class that sets none
    from lightning_troll.models import loading as models

    policy = models._ready_to_sample(policy, str(tmp_path))
    torch.manual_seed(0)
    ids, _, response_mask, _ = sample(policy, [[1, 5], [1, 6, 7]], 2, SamplingConfig(), 0, 2)
    assert ids.shape[0] == 4 and response_mask.shape[1] <= SamplingConfig().max_new_tokens
    with pytest.raises(ValueError, match=r"loads as Linear, which has no generate\(\)"):
        models._ready_to_sample(torch.nn.Linear(2, 2), "x")


def test_the_models_own_generation_settings_do_not_change_sampling(tiny_model_dir):
    """A hub model's generation_config (repetition penalty, banned n-grams, a minimum length)
    would change the distribution completions come from, away from the one the rollout caches
    and the loss uses: sampling sets it aside, and leaves it in place afterwards."""
    policy = load_policy(tiny_model_dir)
    prompts, options = [[1, 5, 6], [1, 7]], SamplingConfig(max_new_tokens=6)
    plain = sample(policy, prompts, 1, options, 0, 2, do_sample=False)[0]
    own = policy.generation_config
    own.repetition_penalty, own.no_repeat_ngram_size, own.min_new_tokens = 50.0, 1, 6
    width = max(len(p) for p in prompts)
    ids, mask = plain[:, :width], (plain[:, :width] != 0).long()
    shaped = policy.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=6, pad_token_id=0, eos_token_id=2)  # fmt: skip
    assert not torch.equal(shaped[:, width:], plain[:, width:])  # the settings bite
    assert torch.equal(sample(policy, prompts, 1, options, 0, 2, do_sample=False)[0], plain)
    assert policy.generation_config is own and own.repetition_penalty == 50.0


def test_nan_weights_stop_sampling_with_a_floating_point_error(tiny_model_dir):
    module = make_module(tiny_model_dir)
    with torch.no_grad():
        module.old_policy.model.norm.weight[0] = float("nan")
    with pytest.raises(
        FloatingPointError, match=r"weight 'model.norm.weight' holds NaN or inf at 1"
    ):
        sample(
            module.old_policy,
            [[1, 5, 6]],
            2,
            module.sampling,
            module.policies.pad_id,
            module.policies.eos_id,
        )


def test_the_global_random_states_come_back_per_rank(tiny_model_dir):
    import random

    import numpy as np

    module = make_module(tiny_model_dir)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert list(checkpoint["lightning_troll"]["rng"]) == [0]  # keyed by global rank
    expected = (torch.rand(3), random.random(), np.random.rand())
    module.on_load_checkpoint(checkpoint)
    module.on_train_start()  # where a resumed fit sets them
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]
    checkpoint["lightning_troll"]["rng"] = {1: checkpoint["lightning_troll"]["rng"][0]}
    with pytest.warns(UserWarning, match=r"no random state for global ranks \[0\]"):
        module.on_load_checkpoint(checkpoint)


def test_every_config_class_of_the_module_loads_with_weights_only():
    """Checkpoints keep the module's config objects in their hyper-parameters and Lightning
    loads them with weights_only=True: every config dataclass must be allow-listed."""
    import dataclasses
    import inspect
    import typing

    from lightning_troll.training.module import TrollModule

    hints = typing.get_type_hints(TrollModule.__init__)
    configs = set()
    for name in inspect.signature(TrollModule.__init__).parameters:
        for kind in (hints.get(name), *typing.get_args(hints.get(name))):
            if dataclasses.is_dataclass(kind):
                configs.add(kind)
    assert len(configs) >= 7
    assert configs <= set(torch.serialization.get_safe_globals())
