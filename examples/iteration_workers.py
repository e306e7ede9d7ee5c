"""The configurations ``examples/benchmark_iteration.py`` times, each run in a process of its own
(``benchmark_iteration.py --worker``): ours through ``TrollModule`` and a Lightning ``Trainer``,
and TRL's ``GRPOTrainer`` (in a Python that imports trl). Each returns per iteration the wall
time and its split, and the process's peak memory (:func:`peak_memory.peak_memory_gib`).

The benchmark's prompts, reward and sampling settings are here too, for both sides and for
:mod:`iteration_checks`.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

from lightning_troll.training.module import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import peak_memory_gib, reset_peak, status_mib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
INSTRUCTION = " Answer with only the number."
PROMPTS, GROUP, TEMPERATURE, LR = 8, 8, 0.7, 1e-5


def pick_rows(count: int = PROMPTS, seed: int = 0) -> list[dict]:
    """``count`` rows of the arithmetic training prompts, drawn with ``seed``."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return random.Random(seed).sample(rows, count)


# ------------------------------------------------------------------------------------ ours


def memory_phases():
    """A callback that records ours' resident memory by phase of each iteration (Lightning is
    imported here: TRL's Python runs this module too)."""
    from lightning.pytorch import Callback

    class Phases(Callback):
        """Resident memory by phase of an iteration (MiB): the level as it starts, then each
        phase's peak (the kernel's high-water mark, reset at each boundary; a phase repeated
        by several optimiser steps keeps its highest). Runs after the rollout's callback."""

        def __init__(self) -> None:
            self.marks: dict[str, float] = {}
            self.highest = 0.0
            """The process's peak so far (MiB): resetting the high-water mark resets the one
            ``ru_maxrss`` reports too, so the peak is kept here across resets."""

        def high_water(self) -> float:
            value = status_mib("VmHWM")
            self.highest = max(self.highest, value)
            reset_peak()
            return value

        def begin(self) -> None:
            self.high_water()
            self.marks = {"start": status_mib("VmRSS")}

        def mark(self, phase: str) -> None:
            self.marks[phase] = max(self.marks.get(phase, 0.0), self.high_water())

        def take(self) -> dict[str, float]:
            marks, self.marks = self.marks, {}
            return marks

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.mark("rollout")

        def on_before_backward(self, trainer, pl_module, loss):
            self.mark("forward and loss")

        def on_after_backward(self, trainer, pl_module):
            self.mark("backward")

    return Phases()


def run_ours(spec: dict) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_troll.callbacks import (
        OldPolicyRefresh,
        ReleaseFreedMemory,
        RolloutGeneration,
        SparsityCoverageMonitor,
        TrustRegionMonitor,
    )
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.models.snapshots import SnapshotConfig
    from lightning_troll.tasks.data import PromptDataModule
    from lightning_troll.training.module import OptimizationConfig, TrollModule

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    tiny = spec["tiny"]

    class Timer(Callback):
        """Wall time of each whole iteration and the split the module logged."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            phases.begin()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            phases.mark("optimiser step")  # and the callbacks' ends of the iteration
            total = time.perf_counter() - self.start
            m = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
            self.rows.append(
                {
                    "total": total,
                    "generation": m["time/generation"],
                    "rest_of_rollout": m["time/rollout"] - m["time/generation"],
                    "training": m["time/training"],
                    "mean_length": m["completion/mean_length"],
                    "tokens_per_s": m["throughput/generated_tokens_per_s"],
                    "memory_mib": phases.take(),
                }
            )

    phases = memory_phases()

    with tempfile.TemporaryDirectory() as tmp:
        if tiny:
            data = PromptDataModule(
                source="tinymath", batch_size=PROMPTS, num_train=PROMPTS, num_val=0
            )
            rewards, model = {"tinymath": 1.0}, "tinymath"
        else:
            path = Path(tmp) / "prompts.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in pick_rows()))
            data = PromptDataModule(
                source=str(path),
                val_file=str(path),
                num_train=None,
                num_val=None,
                prompt_field="question",
                template="{question}" + INSTRUCTION,
                chat_template=True,
                tokenizer=spec["model"],
                batch_size=PROMPTS,
            )
            rewards, model = {"last_number": 1.0}, spec["model"]
        module = TrollModule(
            model=model,
            objective=spec["objective"],
            group_size=GROUP,
            sampling=SamplingConfig(temperature=TEMPERATURE, max_new_tokens=spec["max_new_tokens"]),
            rewards=rewards,
            optimization=OptimizationConfig(
                epochs_per_rollout=spec["steps"],
                share_prompts=spec["share_prompts"],
                gradient_checkpointing=spec.get("checkpointing", False),
            ),
            optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
            snapshot=SnapshotConfig(mode="shared"),
            engine=EngineConfig(
                spec.get("engine", "hf"),
                {"kv_cache_gib": 1} if spec.get("engine") == "vllm" else None,
                spec["behaviour"],
            ),
        )
        timer = Timer()
        trainer = Trainer(
            accelerator="auto",
            devices=1,
            max_steps=spec["iterations"] * spec["steps"],
            callbacks=[
                timer,
                RolloutGeneration(log_samples=0),
                ReleaseFreedMemory(enabled=spec.get("release")),
                phases,
                OldPolicyRefresh(),
                TrustRegionMonitor(),
                SparsityCoverageMonitor(),
            ],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, datamodule=data)
    peak = peak_memory_gib()  # on CUDA the allocator's; the phases' resets do not touch it
    if not torch.cuda.is_initialized():  # the resident peak, kept across the phases' resets
        peak = max(phases.highest, status_mib("VmHWM")) / 1024
    return {"iterations": timer.rows, "peak_memory_gib": peak}


# ------------------------------------------------------------------------------------- TRL


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))  # the same reward function as ours (it needs torch only)
    from lightning_troll.tasks.rewards import last_number

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    rows = pick_rows()
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"] + INSTRUCTION}],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )

    def reward(prompts, completions, answer, **_):
        return [
            last_number("", c[0]["content"] if isinstance(c, list) else c, {"answer": a})
            for c, a in zip(completions, answer, strict=True)
        ]

    seconds = {"generation": [], "rollout": []}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key].append(time.perf_counter() - start)

        return wrapper

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.start)

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model.generate = timed(model.generate, "generation")
    steps = spec["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            fp16=False,
            learning_rate=LR,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            per_device_train_batch_size=PROMPTS * GROUP,
            gradient_accumulation_steps=1,
            num_generations=GROUP,
            max_completion_length=spec["max_new_tokens"],
            temperature=TEMPERATURE,
            num_iterations=steps,
            beta=0.0,
            gradient_checkpointing=spec["checkpointing"],
            max_steps=spec["iterations"] * steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer._generate_and_score_completions = timed(
            trainer._generate_and_score_completions, "rollout"
        )
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
    lengths = [
        e["completions/mean_length"]
        for e in trainer.state.log_history
        if "completions/mean_length" in e
    ]
    iterations = []
    for i in range(spec["iterations"]):
        total = sum(timer.steps[i * steps : (i + 1) * steps])
        rollout, generation = seconds["rollout"][i], seconds["generation"][i]
        iterations.append(
            {
                "total": total,
                "generation": generation,
                "rest_of_rollout": rollout - generation,
                "training": total - rollout,
                "mean_length": length_of(lengths, i, steps),
                "tokens_per_s": length_of(lengths, i, steps) * PROMPTS * GROUP / generation,
            }
        )
    return {"iterations": iterations, "peak_memory_gib": peak_memory_gib()}


def length_of(lengths: list[float], iteration: int, steps: int) -> float:
    """TRL's logged mean completion length of an iteration: logged once per iteration, or once
    per optimiser step (the iteration's first is taken); NaN if it was not logged."""
    index = iteration if len(lengths) <= iteration * steps else iteration * steps
    return lengths[index] if index < len(lengths) else float("nan")


def chat_prompt_ids(tokenizer) -> list[list[int]]:
    """The benchmark's prompts in the chat template, as token ids (one per prompt)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"] + INSTRUCTION}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for r in pick_rows()
    ]
