"""The phases of ``examples/gpu_check.py`` (:mod:`gpu_phases`) that are whole fits through Lightning.

- ``tinymath-demo``: ``lightning-troll fit --config configs/tinymath.yaml``, shortened, on this
  device;
- ``loop-paths``: the same, shortened further, once for each path of the training loop that the
  demo does not take (the engine in a process of its own, the proximal anchor under stale data,
  multi-turn episodes), each checked for what that path promises;
- ``grpo-smollm2``: one GRPO iteration at SmolLM2-135M's shape (randomly initialised, a character
  tokenizer) through ``TrollModule`` and a Lightning ``Trainer``, bf16-true on a GPU.
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import (  # noqa: E402
    SMOLLM2,
    TINY_SMOLLM2,
    Shape,
    clock,
    default_dtype,
    model_dtype,
    shape_figures,
    shape_table,
)

from lightning_troll.tasks.environments import Environment, Step  # noqa: E402

if TYPE_CHECKING:
    from gpu_phases import Results

ROOT = Path(__file__).resolve().parents[1]


def tinymath_args(accelerator: str, rollouts: int, logs: str, tiny: bool) -> list[str]:
    """``fit --config configs/tinymath.yaml`` for ``rollouts`` rollouts (two optimiser steps each)
    on ``accelerator``, validating once at the end, logs under ``logs``, no checkpoint; with
    ``tiny``, 16 prompts x 8 completions in two minibatches of 64 sequences. The config comes
    first: options after it override it."""
    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"),
            f"--trainer.accelerator={accelerator}", f"--trainer.max_steps={2 * rollouts}",
            f"--trainer.val_check_interval={rollouts}", f"--trainer.default_root_dir={logs}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]  # fmt: skip
    if tiny:
        args += ["--data.batch_size=16", "--data.num_val=32", "--data.val_batch_size=32",
                 "--model.optimization.minibatch_size=64"]  # fmt: skip
    return args


def tinymath_demo(results: Results, tiny: bool) -> None:
    """``lightning-troll fit --config configs/tinymath.yaml``, shortened, on this device."""
    import torch

    from lightning_troll.callbacks import RolloutGeneration
    from lightning_troll.cli import run

    rollouts = 2 if tiny else 100
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as logs:
        start = clock()
        cli = run(tinymath_args(accelerator, rollouts, logs, tiny))
        seconds = clock() - start
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    rollout = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutGeneration))
    rewards = rollout.mean_rewards
    quarter = max(1, len(rewards) // 4)
    results.update(
        accelerator=accelerator,
        rollouts=len(rewards),
        fit_s=round(seconds, 2),
        rollouts_per_s=round(len(rewards) / seconds, 3),
        final_reward=round(rewards[-1], 4),
        reward_first_quarter=round(sum(rewards[:quarter]) / quarter, 4),
        reward_last_quarter=round(sum(rewards[-quarter:]) / quarter, 4),
        val_accuracy=round(metrics["val/accuracy"], 4),
        kl_after_max=round(metrics["trust_region/kl_after_max"], 5),
        summary=f"{len(rewards)} rollouts in {seconds:.1f} s, reward {rewards[0]:.3f} -> "
        f"{rewards[-1]:.3f}, val accuracy {metrics['val/accuracy']:.3f}",
    )


class PlusOneTurns(Environment):
    """Two-turn plain-text episodes for TinyMath, which has no chat template: the prompt, the
    model's answer, the reply ``"+1="``, the model's second answer."""

    def reset(self, row: Any) -> str:
        self.left = 2
        return str(row["prompt"])

    def step(self, turn: str) -> Step:
        self.left -= 1
        return Step(done=True) if self.left <= 0 else Step("+1=")


LOOP_PATHS: dict[str, list[str]] = {
    "engine-process": ["--model.engine.options={process: true, threads: 2}",
                       "--old_policy.max_staleness=1"],
    "proximal": ["--old_policy.max_staleness=2", "--model.corrections.anchor=proximal"],
    "episodes": ["--model.episodes.environment=gpu_fits:PlusOneTurns",
                 "--model.sampling.max_new_tokens=16"],
    "stop-flags-every-8": ["--model.sampling.check_every=8"],
}  # fmt: skip
"""The paths of the loop that ``tinymath-demo`` does not take: options over configs/tinymath.yaml.
On a GPU ``stop-flags-every-8`` samples with the CUDA-graph path's whole step captured (the draw
and the behaviour recorder in the graph); on a CPU the dynamic loop ignores the option."""
PATH_FIGURES = {
    "engine-process": [
        "engine/process_prefetched",
        "engine/process_wait_s",
        "engine/weight_push_s",
    ],
    "proximal": ["rollout/proximal_is_weight_mean"],
    "episodes": ["episodes/turns_mean"],
    "stop-flags-every-8": [],
}
"""What each path logs, beside every run's reward, staleness and KL, that :func:`path_figures` checks."""


def logged_series(logs: Path) -> dict[str, list[float]]:
    """Every figure a run's CSV logger wrote under ``logs``, in the order logged."""
    (path,) = logs.rglob("metrics.csv")
    series: dict[str, list[float]] = defaultdict(list)
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None):
                    series[name].append(float(value))
    return series


def path_figures(name: str, series: dict[str, list[float]], rollouts: int) -> dict[str, Any]:
    """One loop path's figures, checked against what the path promises: every rollout trained;
    the sampler as stale as the option allows; the engine apart sampled every rollout after the
    first ahead; the proximal weight logged; each episode played one or two turns. Raises
    ``AssertionError`` naming what failed, or the figures it needs that were not logged."""
    needed = ["reward/mean", "rollout/staleness", "trust_region/kl_after_max", *PATH_FIGURES[name]]
    missing = [figure for figure in needed if not series.get(figure)]
    if missing:
        raise AssertionError(f"{name}: the run logged no {', '.join(missing)}")
    rewards, staleness = series["reward/mean"], series["rollout/staleness"]
    row: dict[str, Any] = {"path": name, "rollouts": len(rewards),
                           "final_reward": round(rewards[-1], 4),
                           "kl_after_max": round(max(series["trust_region/kl_after_max"]), 5),
                           "staleness_max": max(staleness)}  # fmt: skip
    problems = [] if len(rewards) == rollouts else [f"{len(rewards)} rollouts of {rollouts}"]
    allowed = next((int(o.split("=")[1]) for o in LOOP_PATHS[name]
                    if o.startswith("--old_policy.max_staleness=")), 0)  # fmt: skip
    if max(staleness) != allowed:
        problems.append(f"rollout/staleness reached {max(staleness)}, not {allowed}")
    if name == "engine-process":
        ahead = series["engine/process_prefetched"]
        row["prefetched_share"] = round(statistics.fmean(ahead[1:]), 4)
        row["process_wait_s"] = round(statistics.median(series["engine/process_wait_s"]), 4)
        row["weight_push_s"] = round(statistics.median(series["engine/weight_push_s"]), 4)
        if len(ahead) != rollouts or ahead[0] != 0 or row["prefetched_share"] != 1:
            problems.append(f"engine/process_prefetched was {ahead}: sampled ahead after the first")
    if name == "proximal":
        weights = series["rollout/proximal_is_weight_mean"]
        row["proximal_is_weight_mean"] = round(statistics.fmean(weights), 5)
        if len(weights) != rollouts or not all(math.isfinite(w) and w > 0 for w in weights):
            problems.append(f"rollout/proximal_is_weight_mean was {weights}")
    if name == "episodes":
        turns = series["episodes/turns_mean"]
        row["turns_mean"] = round(statistics.fmean(turns), 3)
        if len(turns) != rollouts or not all(1 <= t <= 2 for t in turns):
            problems.append(f"episodes/turns_mean was {turns}, not in [1, 2] at every rollout")
    if problems:
        raise AssertionError(f"{name}: " + "; ".join(problems))
    return row


def loop_paths(results: Results, tiny: bool) -> None:
    """A short TinyMath fit on this device for each of :data:`LOOP_PATHS`, each checked by
    :func:`path_figures`; a path that fails is a row with its error, the next one still runs,
    and the phase fails at the end."""
    import torch

    from lightning_troll.cli import run

    rollouts = 3 if tiny else 20
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    results.update(accelerator=accelerator)
    failed = []
    for name, options in LOOP_PATHS.items():
        with tempfile.TemporaryDirectory() as logs:
            args = tinymath_args(accelerator, rollouts, logs, tiny) + options
            args += ["--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                     f"--trainer.logger.save_dir={logs}"]  # fmt: skip
            start = clock()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    run(args)
                row = path_figures(name, logged_series(Path(logs)), rollouts)
                fell = [str(w.message) for w in caught if "CUDA-graph" in str(w.message)]
                if fell and accelerator == "gpu":
                    raise AssertionError(f"{name}: the CUDA-graph path did not serve: {fell[0]}")
            except (Exception, SystemExit) as error:  # noqa: BLE001 - recorded, then raised below
                row = {"path": name, "error": f"{type(error).__name__}: {error}"}
                failed.append(name)
            row["fit_s"] = round(clock() - start, 2)
        results.add_row(row)
    if failed:
        raise RuntimeError(f"loop-paths: failed on {failed}")
    times = ", ".join(f"{row['path']} {row['fit_s']:.1f} s" for row in results.rows)
    results.update(summary=f"{len(LOOP_PATHS)} paths, {rollouts} rollouts each: {times}")


def parity_reward(prompt: str, completion: str, row) -> float:
    """A stand-in reward for a randomly initialised model: the CRC-32 parity of the completion
    (any reward is arbitrary there; this one gives each group a spread)."""
    import zlib

    return float(zlib.crc32(completion.encode("utf-8")) % 2)


def smollm2_directory(path: Path, shape: Shape) -> None:
    """A randomly initialised model of ``shape`` and a character tokenizer of as many tokens
    (TinyMath's 17, then one code point each), saved like a hub model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_troll.models.tinymath import CHARACTERS, SPECIAL_TOKENS, char_tokenizer

    extra = shape.vocab - len(SPECIAL_TOKENS) - len(CHARACTERS)
    tokenizer = char_tokenizer(CHARACTERS + "".join(chr(0x100 + i) for i in range(extra)))
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=2048,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with default_dtype(model_dtype()):
        LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def grpo_smollm2(results: Results, tiny: bool) -> None:
    """One GRPO iteration (a rollout, then two TROLL steps) at SmolLM2-135M's shape through
    ``TrollModule`` and a Lightning ``Trainer``: bf16-true on a GPU."""
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration, TrustRegionMonitor
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.tasks.rewards import REWARD_FUNCTIONS, register_reward
    from lightning_troll.training.module import OptimizationConfig, TrollModule

    cuda = torch.cuda.is_available()
    shape, prompts, group, new_tokens = (TINY_SMOLLM2, 4, 4, 8) if tiny else (SMOLLM2, 32, 8, 128)
    if "parity" not in REWARD_FUNCTIONS:
        register_reward("parity")(parity_reward)
    marks: dict[str, float] = {}

    class Mark(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks[self.name] = clock()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["trained"] = clock()

    with tempfile.TemporaryDirectory() as model_dir:
        start = clock()
        smollm2_directory(Path(model_dir), shape)
        module = TrollModule(
            model=model_dir,
            dtype="bfloat16" if cuda else "float32",
            group_size=group,
            sampling=SamplingConfig(max_new_tokens=new_tokens),
            rewards={"parity": 1.0},
            optimization=OptimizationConfig(minibatch_size=prompts * group // 2),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
        )
        data = PromptDataModule(source="tinymath", tokenizer=model_dir, batch_size=prompts,
                                num_train=prompts, num_val=0)  # fmt: skip
        rollout = RolloutGeneration(log_samples=0)
        monitor = TrustRegionMonitor(histogram_every_n_rollouts=1000)
        trainer = Trainer(
            accelerator="gpu" if cuda else "cpu", devices=1,
            precision="bf16-true" if cuda else "32-true", max_steps=2, logger=False,
            callbacks=[Mark("start"), rollout, Mark("sampled"), OldPolicyRefresh(), monitor],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        built = clock()
        trainer.fit(module, datamodule=data)
        done = clock()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    results.update(
        **shape_figures("smollm2-135m", shape),
        shapes=shape_table({"smollm2-135m": shape}),
        sequences=prompts * group,
        new_tokens=new_tokens,
        precision=trainer.precision,
        build_s=round(built - start, 2),
        fit_s=round(done - built, 2),
        rollout_s=round(marks["sampled"] - marks["start"], 3),
        train_s=round(marks["trained"] - marks["sampled"], 3),
        final_reward=round(metrics["reward/mean"], 4),
        kl_after_max=round(metrics["trust_region/kl_after_max"], 5),
        mean_length=round(metrics["completion/mean_length"], 2),
        summary=f"iteration {marks['trained'] - marks['start']:.2f} s (rollout "
        f"{marks['sampled'] - marks['start']:.2f} s), reward {metrics['reward/mean']:.3f}",
    )
