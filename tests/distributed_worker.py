"""A training run for the multi-process tests: ``python tests/distributed_worker.py OUT ...``.

Lightning starts the other processes by running this script again, so everything it needs is
set up at import time of ``main``. Completions come from :func:`scripted_sample`, a function of
the prompt and the sample's index in its group, so a run's global batch does not depend on how
many processes share it; everything after sampling (rewards, advantages, the cached old
distributions, the loss, gradients, optimiser, refresh, monitors) is the real code.

``--accelerator gpu --devices N`` runs the processes on N CUDA devices (NCCL) instead of CPUs
(gloo). ``--real-sampling`` keeps the real sampler instead (for resume tests, where every process's
random state matters). Rank 0 writes ``OUT/metrics.json`` (the logged value of every metric at every step),
``OUT/weights.pt`` (the policy's and the snapshot's full weights after the run, and greedy
completions of a few prompts), ``OUT/gathers.json`` (FSDP2 runs: all-gathers while sampling),
``OUT/rng.json`` (a digest of each process's torch random state as its first step began) and,
if asked, ``OUT/loaded.pt`` (the weights and step right after a checkpoint was loaded).
``--validate N`` validates on N held-out rows instead of training and writes the figures to
``OUT/validated.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import sys
from pathlib import Path

import torch

from lightning_troll.training.module import AdvantageConfig, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # for tests.reward_helpers when run as a script
    sys.path.insert(0, str(ROOT))

STEPS_PER_ROLLOUT = 2  # epochs_per_rollout: the second pass over a rollout is off-policy


def scripted_sample(
    model, prompt_ids, group_size, sampling, pad_id, eos_id, do_sample=True, recorder=None,
    budgets=None,
):  # fmt: skip
    """Stands in for :func:`lightning_troll.engines.sampling.sample`: the j-th completion of a prompt is
    a fixed function of (prompt, j), of varying length, ended by EOS unless it fills the budget.
    ``eos_id`` is one id or several (the module's stop ids); the first ends the completions.
    A ``recorder`` is fed the model's logits position by position, as ``generate`` feeds it.
    Single-turn runs only: a prompt's own ``budgets`` (an episode's turn) are refused."""
    from lightning_troll.engines.sampling import left_pad, response_mask_of
    from lightning_troll.rollouts.rollout import position_ids

    if budgets is not None:
        raise NotImplementedError("scripted_sample stands in for single-turn rollouts only")

    stop = eos_id if isinstance(eos_id, int) else eos_id[0]
    budget = sampling.max_new_tokens
    vocab = model.config.vocab_size
    rows = []
    for ids in prompt_ids:
        for j in range(group_size):
            key = sum(ids) * 31 + 7 * j
            length = 1 + (sum(ids) + j * j) % budget  # groups differ in their token counts
            tokens = [4 + (key + 13 * t) % (vocab - 4) for t in range(length)]
            rows.append((ids, tokens + ([stop] if length < budget else [])))
    device = next(model.parameters()).device
    prompts, prompt_mask = left_pad([p for p, _ in rows], pad_id, device)
    responses = torch.full((len(rows), budget), pad_id, dtype=torch.long, device=device)
    for i, (_, tokens) in enumerate(rows):
        responses[i, : len(tokens)] = torch.tensor(tokens[:budget])
    response_mask, truncated = response_mask_of(responses, eos_id)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=-1)
    input_ids = torch.cat([prompts, responses], dim=-1)
    if recorder is not None:
        full = torch.cat([prompt_mask, torch.ones_like(responses)], dim=-1)
        with torch.no_grad():
            logits = model(
                input_ids=input_ids, attention_mask=full, position_ids=position_ids(full)
            ).logits[:, prompts.shape[1] - 1 : -1]  # (B, T, V)
        for t in range(budget):
            recorder(input_ids[:, : prompts.shape[1] + t], logits[:, t])
    return input_ids, attention_mask, response_mask, truncated


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights as plain CPU tensors (sharded ones gathered: every rank must call)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value)
        .detach()
        .to("cpu", copy=True)
        for name, value in module.state_dict().items()
    }


def build(args, out: Path):
    """The module, data and trainer of one run."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_troll.callbacks import (
        OldPolicyRefresh,
        RolloutGeneration,
        SparsityCoverageMonitor,
        TrustRegionMonitor,
    )
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.models.lora import LoraConfig
    from lightning_troll.models.snapshots import SnapshotConfig
    from lightning_troll.objectives.options import TrustRegionConfig
    from lightning_troll.tasks.data.datamodule import PromptDataModule
    from lightning_troll.training.checkpoint_io import install_atomic_saves
    from lightning_troll.training.module import OptimizationConfig, TrollModule

    class DumpLoaded(Callback):
        """Writes what a checkpoint restored, before any training step changes it."""

        def on_train_start(self, trainer, pl_module):
            state = {
                "policy": full_state(pl_module.policy),
                "old_policy": full_state(pl_module.old_policy),
                "global_step": trainer.global_step,
            }
            if trainer.is_global_zero:
                torch.save(state, out / "loaded.pt")

    class RecordRandomState(Callback):
        """Writes a digest of every process's torch random state as the first step of this
        process begins (after the module's ``on_train_start``): ``OUT/rng.json``, by rank."""

        done = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.done:
                return
            self.done = True
            digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
            everyone = [digest]
            if trainer.world_size > 1:
                everyone = [None] * trainer.world_size
                torch.distributed.all_gather_object(everyone, digest)
            if trainer.is_global_zero:
                (out / "rng.json").write_text(json.dumps(everyone))

    processes = 1 if args.strategy == "single" else args.devices
    module = TrollModule(
        model="tinymath",
        objective=args.objective,
        advantages=AdvantageConfig(args.estimator),
        group_size=4,
        # mass_delta 0: the support is TinyMath's whole vocabulary (17 < max_tokens), fixed. A
        # support cut by mass would end at a token near 1e-6, and float32 rounding of another
        # reduction order could move it across the cut (a discrete change of the projection).
        trust_region=TrustRegionConfig(mass_delta=0.0),
        sampling=SamplingConfig(max_new_tokens=4),
        rewards={args.reward: 1.0},
        optimization=OptimizationConfig(
            epochs_per_rollout=STEPS_PER_ROLLOUT,
            micro_batch_size=args.micro_batch_size,
            gradient_clip_norm=1.0,
            gradient_checkpointing=args.gradient_checkpointing,
        ),
        # eps well above the tiniest gradients: Adam would otherwise blow their float32 noise
        # (which differs with the order of reductions) up to steps of about lr
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-4, foreach=False),
        snapshot=SnapshotConfig(*args.snapshot.split(":")),
        lora=LoraConfig(r=4) if args.lora else None,
        engine=EngineConfig(args.engine, {"kv_cache_gib": 0.25} if args.engine == "vllm" else None),
    )
    data = PromptDataModule(
        source="tinymath",
        tokenizer="tinymath",
        batch_size=args.prompts // processes,  # per process: the global batch is the same
        num_train=64,
        num_val=args.validate,
        val_batch_size=2,
    )
    strategy = {
        "single": "auto",
        "ddp": DDPStrategy(process_group_backend="gloo" if args.accelerator == "cpu" else "nccl"),
        "fsdp2": ModelParallelStrategy(data_parallel_size=processes, tensor_parallel_size=1),
    }[args.strategy]
    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh()]
    callbacks += [TrustRegionMonitor(histogram_every_n_rollouts=1000), SparsityCoverageMonitor()]
    callbacks.append(RecordRandomState())
    if args.ckpt_path:
        callbacks.append(DumpLoaded())
    if args.checkpoint_every:
        every = args.checkpoint_every * STEPS_PER_ROLLOUT
        callbacks.append(ModelCheckpoint(out / "ckpts", every_n_train_steps=every, save_top_k=-1))
    trainer = Trainer(
        accelerator=args.accelerator,  # FSDP2 over gloo on CPUs, over NCCL on GPUs
        devices=processes,
        strategy=strategy,
        max_steps=args.rollouts * STEPS_PER_ROLLOUT,
        precision=args.precision,
        logger=CSVLogger(out, name="csv", version=0),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    install_atomic_saves(trainer.strategy)  # as the command line does: ModelCheckpoint's too
    return module, data, trainer


def gather_counts(module, prompts: list[list[int]]) -> dict[str, int]:
    """All-gathers issued by sampling 8 tokens from the snapshot, with and without
    :func:`~lightning_troll.models.sharding.gathered` (real sampling, no script)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from lightning_troll.engines.sampling import SamplingConfig, sample
    from lightning_troll.models.sharding import gathered

    calls = {"n": 0}
    # What FSDP2 gathers weights with: all_gather_single in torch 2.13; torch 2.11 (the GPU
    # image's) has no such function and calls all_gather_into_tensor
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    sampling = SamplingConfig(max_new_tokens=8)
    sharded = [m for m in module.old_policy.modules() if isinstance(m, FSDPModule)]
    counts = {"modules": len(sharded)}
    setattr(dist, name, counting)
    try:
        for name, context in (("per_token", contextlib.nullcontext), ("gathered", gathered)):
            for m in sharded:  # both start from sharded weights
                m.reshard()
            calls["n"] = 0
            with context(module.old_policy):
                ids, *_ = sample(module.old_policy, prompts, 2, sampling, 0, 0, do_sample=False)
            counts[name] = calls["n"]
            counts[f"{name}_steps"] = ids.shape[1] - max(len(p) for p in prompts)
    finally:
        setattr(dist, name, original)
    return counts


def greedy(module) -> torch.Tensor:
    """Greedy completions of a few prompts by the trained policy, as validation makes them."""
    from lightning_troll.engines.sampling import SamplingConfig, sample
    from lightning_troll.models.sharding import gathered

    prompts = [module.tokenizer.encode(p) for p in ("12+34=", "7-9=", "50+50=")]
    with gathered(module.policy):
        ids, *_ = sample(
            module.policy, prompts, 1, SamplingConfig(max_new_tokens=6), module.policies.pad_id,
            module.policies.eos_id, do_sample=False,
        )  # fmt: skip
    return ids.cpu()


def logged_metrics(out: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from the CSV logger's file."""
    metrics: dict[str, dict[int, float]] = {}
    with (out / "csv" / "version_0" / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if name != "step" and value not in ("", None):
                    metrics.setdefault(name, {})[int(row["step"])] = float(value)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp2"], default="single")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes of ddp and fsdp2")
    parser.add_argument("--objective", default="troll")
    parser.add_argument("--estimator", default="reinforce_pp")
    parser.add_argument("--prompts", type=int, default=4, help="global prompts per rollout")
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--snapshot", default="copy:same", help="snapshot mode:dtype")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--real-sampling", action="store_true", help="sample with generate")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout engine")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="rollouts, 0: never")
    parser.add_argument("--save", type=Path, default=None, help="checkpoint written at the end")
    parser.add_argument("--ckpt-path", type=Path, default=None, help="checkpoint to resume")
    parser.add_argument("--reward", default="tests.reward_helpers:length_reward")
    parser.add_argument("--validate", type=int, default=0, help="validate on N rows, no fit")
    args = parser.parse_args(argv)

    import lightning_troll.engines.hf as engines

    if not args.real_sampling and args.engine == "hf":  # the HF engine samples with it
        engines.sample = scripted_sample
    # One intra-op thread per process, as Lightning gives each of 2 processes on 2 cores: with
    # two, the one-process reference was not bit-repeatable (1 run in 6 took another float32
    # rounding path, which Adam's first step turned into a 0.3% change of the policy loss).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    module, data, trainer = build(args, args.out)
    if args.validate:
        trainer.validate(module, datamodule=data)
        if trainer.is_global_zero:
            figures = {name: float(v) for name, v in trainer.callback_metrics.items()}
            (args.out / "validated.json").write_text(json.dumps(figures))
        return
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    if args.save:
        trainer.save_checkpoint(args.save)
    weights = {"policy": full_state(module.policy), "old_policy": full_state(module.old_policy)}
    weights["greedy"] = greedy(module)
    if args.strategy == "fsdp2":
        counts = gather_counts(module, [[5, 6, 7], [8, 9]])
        if trainer.is_global_zero:
            (args.out / "gathers.json").write_text(json.dumps(counts))
    if trainer.is_global_zero:
        torch.save(weights, args.out / "weights.pt")
        (args.out / "metrics.json").write_text(json.dumps(logged_metrics(args.out)))


if __name__ == "__main__":
    main()
