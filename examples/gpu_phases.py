"""The phases of ``examples/gpu_check.py``: each runs in a process of its own and writes its figures.

A phase is a function ``fn(results, tiny)``: it records figures on ``results`` as it goes (a
phase that fails or runs out of time keeps what it had recorded) and raises :class:`Skip` when
it cannot run here. ``tiny`` shrinks every shape so that the phase runs on a CPU in seconds.

Language-model shapes (random initialisation: no weights are loaded from anywhere):

- Qwen3-0.6B: hidden 1024, 28 layers, 16 query and 8 key/value heads of 128, MLP 3072;
- Qwen3-1.7B: hidden 2048, 28 layers, 16 / 8 heads of 128, MLP 6144;
- Qwen3-4B: hidden 2560, 36 layers, 32 / 8 heads of 128, MLP 9728;
  all with V = 151,936 and tied embeddings, in bfloat16 on a GPU;
- SmolLM2-135M: LlamaForCausalLM, hidden 576, 30 layers, 9 / 3 heads of 64, MLP 1536,
  V = 49,152, tied embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import statistics
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"time_ratio": 1.091, "memory_ratio": 1.046}
"""TROLL / clip for one training step of Qwen3-4B in the paper (arXiv 2510.03817)."""
LOGIT_STD = 2.0  # standard deviation of the initial logits, as in benchmark_overhead.py
PAD, EOS = 0, 1  # token ids of the random models


class Skip(Exception):
    """The phase cannot run on this machine; the message says why."""


class Results:
    """A phase's figures, written to ``path`` (JSON) every time they change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def update(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.write()

    def add_row(self, row: dict[str, Any]) -> None:
        """One line of the phase's table (a shape, a test)."""
        self.rows.append(row)
        self.write()

    def write(self, status: str = "running", **extra: Any) -> None:
        figures = {**self.figures, **({"rows": self.rows} if self.rows else {})}
        record = {"status": status, "figures": figures, **extra}
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(record, indent=1, default=float))
        partial.replace(self.path)


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    def parameters(self) -> int:
        """Weights of the decoder layers and the (tied) embedding; norms left out."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.mlp) + self.vocab * self.hidden


QWEN3 = {
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151_936),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151_936),
    "qwen3-4b": Shape(2560, 36, 32, 8, 128, 9728, 151_936),
}
TINY_QWEN3 = {
    "qwen3-0.6b": Shape(32, 2, 2, 1, 16, 64, 512),
    "qwen3-1.7b": Shape(48, 2, 2, 1, 24, 96, 512),
    "qwen3-4b": Shape(64, 2, 4, 2, 16, 128, 512),
}
SMOLLM2 = Shape(576, 30, 9, 3, 64, 1536, 49_152)
TINY_SMOLLM2 = Shape(32, 2, 2, 1, 16, 64, 512)


# -- devices, time and memory ------------------------------------------------------------------
def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock() -> float:
    """Seconds, after the GPU's queued work has finished."""
    synchronize()
    return time.perf_counter()


class PeakMemory:
    """The peak memory of a stretch of work: ``torch.cuda.max_memory_allocated`` on a GPU; on a
    CPU the peak resident set size of the process (``VmHWM``, which includes the interpreter)."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.source = "torch.cuda.max_memory_allocated" if self.cuda else "peak resident set size"

    def reset(self) -> float:
        """Starts a stretch; returns the memory in use now (MiB)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        from peak_memory import peak_mib, reset_peak

        reset_peak()
        return peak_mib()

    def peak(self) -> float:
        """The peak since :meth:`reset` (MiB)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20
        from peak_memory import peak_mib

        return peak_mib()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError)


# -- models and rollouts ------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dtype):
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def model_dtype():
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def qwen3(shape: Shape, seed: int = 0):
    """A randomly initialised Qwen3 model of ``shape`` on the device, in eval mode; the tied
    embedding is redrawn so that logits have a standard deviation of about ``LOGIT_STD``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=PAD,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    with torch.device(device()), default_dtype(model_dtype()):
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight  # (V, H), tied to the output layer
        embedding.normal_(0.0, LOGIT_STD / math.sqrt(shape.hidden))
    return model.eval()


def snapshot_and_policy(shape: Shape, perturb: float = 0.0):
    """The frozen snapshot and a trainable copy moved away from it by ``perturb`` x each weight
    tensor's standard deviation of normal noise (so that TROLL projects some tokens)."""
    import torch

    snapshot = qwen3(shape).requires_grad_(False)
    policy = copy.deepcopy(snapshot).train().requires_grad_(True)
    if perturb:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(perturb * p.float().std().to(p.dtype) * torch.randn_like(p))
    return snapshot, policy


def sparsify_for(objective):
    """The old policy's sparse rows for TROLL (None for clipping), as the module caches them."""
    from lightning_troll.sparse import sparsify

    projection = getattr(objective, "projection", None)
    if projection is None:
        return None
    return lambda rows, tokens: sparsify(
        rows, projection.max_tokens, projection.mass_delta, keep=tokens
    )


def make_rollout(snapshot, objective, ids, attention, response, rewards, group, chunk):
    """A :class:`~lightning_troll.rollout.Rollout` with the snapshot's cached outputs."""
    from lightning_troll.advantages import compute_advantages
    from lightning_troll.rollout import Rollout, behaviour_outputs

    old_logprobs, old = behaviour_outputs(
        snapshot, ids, attention, response, 1.0, sparsify_for(objective), chunk
    )
    return Rollout(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old_logprobs,
        old=old,
        rewards=rewards,
        advantages=compute_advantages("grpo", rewards, group),
        truncated=response.all(-1),  # no EOS within the budget
        temperature=1.0,
        group_size=group,
    )


def train_step(policy, objective, optimizer, rollout, micro_batch: int | None, chunk: int):
    """One optimiser step on ``rollout``, as ``TrollModule`` takes it: micro-batches weighted by
    their share of the sequences, gradient norm clipped to 1, AdamW; returns the last part's
    statistics."""
    import torch

    from lightning_troll.rollout import linear_head, response_hidden

    stats = None
    for part in rollout.chunks(micro_batch):
        length = part.response_mask.shape[1]
        hidden = response_hidden(policy, part.input_ids, part.attention_mask, length)  # (b, T, H)
        loss, stats = objective.forward_hidden(
            hidden, linear_head(policy), 1.0, part.tokens, part.response_mask,
            part.advantages, part.old_logprobs, part.old, chunk_size=chunk,
        )  # fmt: skip
        (loss * part.num_sequences / rollout.num_sequences).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def shape_figures(name: str, shape: Shape) -> dict[str, Any]:
    return {"shape": name, "parameters_m": round(shape.parameters() / 1e6, 1)}


def shape_table(shapes: dict[str, Shape]) -> dict[str, str]:
    """Each shape in words, for the report."""
    return {
        name: f"hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads of "
        f"{s.head_dim}, MLP {s.mlp}, V {s.vocab}"
        for name, s in shapes.items()
    }


def halving(first: int):
    """first, first // 2, ..., 1: the sizes to try while a shape runs out of GPU memory."""
    size = first
    while size >= 1:
        yield size
        size //= 2


def each_shape(results: Results, shapes: dict[str, Shape], sizes: list[int], measure) -> None:
    """``measure(name, shape, size)`` for every shape, halving ``size`` on running out of GPU
    memory; a shape that fails is recorded as a row with its error, and the others still run.
    Raises at the end if any shape failed."""
    failed = []
    for name, shape in shapes.items():
        row: dict[str, Any] = {}
        for size in sizes:
            retry = False
            try:
                row = {**shape_figures(name, shape), **measure(name, shape, size)}
            except Exception as error:  # noqa: BLE001 - recorded, and the next shape runs
                row = {**shape_figures(name, shape), "error": f"{type(error).__name__}: {error}"}
                retry = out_of_memory(error) and size > 1
                traceback.print_exc()
            free_memory()  # outside the handler: the error's frames no longer hold the tensors
            if not retry:
                break
        results.add_row(row)
        failed += [name] if "error" in row else []
    if failed:
        raise RuntimeError(f"failed at shapes {failed}; see their rows")


# -- phases 1 and 2: the CUDA-only tests ------------------------------------------------------
def pytest_phase(results: Results, keyword: str) -> None:
    """``pytest -m cuda -k keyword`` on ``tests/test_cuda.py``, its outcome per test."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        raise Skip("needs a CUDA device")
    junit = results.path.with_suffix(".junit.xml")
    options = ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}", f"--rootdir={ROOT}"]
    code = pytest.main(
        [str(ROOT / "tests" / "test_cuda.py"), "-m", "cuda", "-k", keyword, *options]
    )
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase") if junit.exists() else []:
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = ((found.get("message") or "").splitlines() or [""])[0][:300]
        counts[outcome] += 1
        seconds = round(float(case.get("time", "nan")), 2)
        results.add_row(
            {"test": case.get("name"), "outcome": outcome, "seconds": seconds, "message": message}
        )
    results.update(**counts, summary=", ".join(f"{n} {k}" for k, n in counts.items() if n))
    if code not in (0, 5) or counts["failed"]:
        failed = [r["test"] for r in results.rows if r["outcome"] == "failed"]
        raise RuntimeError(f"pytest exited with {int(code)}; failed: {failed}")
    if not counts["passed"]:
        reasons = sorted({r["message"] for r in results.rows}) or ["no test selected"]
        raise Skip("every test was skipped: " + "; ".join(reasons))


def cuda_tests(results: Results, tiny: bool) -> None:
    pytest_phase(results, "not nccl")


def fsdp2_nccl(results: Results, tiny: bool) -> None:
    pytest_phase(results, "nccl")


# -- phase 3: TROLL against clip, one training step -------------------------------------------
@dataclass(frozen=True)
class OverheadSetting:
    sequences: int = 4
    prompt: int = 128
    response: int = 896  # prompt + response = 1024 tokens
    chunk: int = 1024
    warmup: int = 2
    repeats: int = 5
    perturb: float = 0.1


TINY_OVERHEAD = OverheadSetting(sequences=2, prompt=8, response=24, chunk=16, warmup=1, repeats=2)


def overhead(results: Results, tiny: bool) -> None:
    """Median step time and peak memory of TROLL and clip at each Qwen3 shape."""
    setting, shapes = (TINY_OVERHEAD, TINY_QWEN3) if tiny else (OverheadSetting(), QWEN3)
    results.update(paper=PAPER, memory=PeakMemory().source, shapes=shape_table(shapes),
                   **asdict(setting))  # fmt: skip

    def measure(name: str, shape: Shape, sequences: int) -> dict[str, Any]:
        return overhead_at(shape, setting, sequences)

    each_shape(results, shapes, list(halving(setting.sequences)), measure)
    rows = [r for r in results.rows if "time_ratio" in r]
    if rows:
        last = rows[-1]
        results.update(
            summary=f"{last['shape']}: time x{last['time_ratio']:.3f}, memory "
            f"x{last['memory_ratio']:.3f} (paper x{PAPER['time_ratio']}, x{PAPER['memory_ratio']})"
        )


def overhead_at(shape: Shape, setting: OverheadSetting, sequences: int) -> dict[str, Any]:
    import torch

    from lightning_troll.objectives import build_objective

    snapshot, policy = snapshot_and_policy(shape, setting.perturb)
    g = torch.Generator(device=device()).manual_seed(0)
    length = setting.prompt + setting.response
    ids = torch.randint(2, shape.vocab, (sequences, length), generator=g, device=device())
    attention = torch.ones_like(ids)
    response = torch.ones(sequences, setting.response, dtype=torch.bool, device=device())
    rewards = torch.randn(sequences, generator=g, device=device())
    meter, row = PeakMemory(), {"sequences": sequences, "tokens": length}
    for name in ("clip", "troll"):
        objective = build_objective(name)
        rollout = make_rollout(snapshot, objective, ids, attention, response, rewards,
                               sequences, setting.chunk)  # fmt: skip
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        for _ in range(setting.warmup):
            train_step(policy, objective, optimizer, rollout, None, setting.chunk)
        baseline = meter.reset()
        times, stats = [], None
        for _ in range(setting.repeats):
            start = clock()
            stats = train_step(policy, objective, optimizer, rollout, None, setting.chunk)
            times.append(clock() - start)
        row[f"{name}_ms"] = round(1000 * statistics.median(times), 2)
        row[f"{name}_peak_mib"] = round(meter.peak(), 1)
        row[f"{name}_baseline_mib"] = round(baseline, 1)
        if name == "troll":
            row["projected_frac"] = round(float(stats.active_frac), 4)
        del optimizer, rollout
        policy.zero_grad(set_to_none=True)
        free_memory()
    row["time_ratio"] = round(row["troll_ms"] / row["clip_ms"], 4)
    row["memory_ratio"] = round(row["troll_peak_mib"] / row["clip_peak_mib"], 4)
    return row


# -- phase 4: generation and the split of a GRPO iteration ------------------------------------
@dataclass(frozen=True)
class GenerationSetting:
    prompts: int = 8
    group: int = 8
    prompt: int = 64
    new_tokens: int = 256
    micro_batch: int = 8
    chunk: int = 1024


TINY_GENERATION = GenerationSetting(prompts=2, group=4, prompt=8, new_tokens=8, micro_batch=4)


def generation(results: Results, tiny: bool) -> None:
    """Tokens per second of sampling, and one GRPO iteration (rollout, then one TROLL step)."""
    setting, shapes = (TINY_GENERATION, TINY_QWEN3) if tiny else (GenerationSetting(), QWEN3)
    results.update(shapes=shape_table(shapes), **asdict(setting))

    def measure(name: str, shape: Shape, micro_batch: int) -> dict[str, Any]:
        return generation_at(shape, setting, micro_batch)

    each_shape(results, shapes, list(halving(setting.micro_batch)), measure)
    rates = [f"{r['shape']} {r['tokens_per_s']:.0f}" for r in results.rows if "tokens_per_s" in r]
    results.update(summary="tokens/s: " + ", ".join(rates))


def generation_at(shape: Shape, setting: GenerationSetting, micro_batch: int) -> dict[str, Any]:
    """Two GRPO iterations (the first warms up): the second's times are reported."""
    import torch

    from lightning_troll.objectives import build_objective
    from lightning_troll.rollout import SamplingConfig, sample

    snapshot, policy = snapshot_and_policy(shape)
    objective = build_objective("troll")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shape.vocab, (setting.prompts, setting.prompt), generator=g).tolist()
    sampling = SamplingConfig(max_new_tokens=setting.new_tokens)
    row: dict[str, Any] = {"sequences": setting.prompts * setting.group, "micro_batch": micro_batch}
    for iteration in ("first", "second"):
        start = clock()
        ids, attention, response, _ = sample(snapshot, prompts, setting.group, sampling, PAD, EOS)
        sampled = clock()
        tokens = ids[:, -response.shape[1] :].masked_fill(~response, 0)
        rewards = (tokens.sum(-1) % 2).float()  # a stand-in: the parity of the token ids' sum
        rollout = make_rollout(snapshot, objective, ids, attention, response, rewards,
                               setting.group, setting.chunk)  # fmt: skip
        collected = clock()
        train_step(policy, objective, optimizer, rollout, micro_batch, setting.chunk)
        trained = clock()
        generated = int(response.sum())
        row.update(
            {
                f"{iteration}_iteration_s": round(trained - start, 3),
                "generated_tokens": generated,
                "generation_s": round(sampled - start, 3),
                "tokens_per_s": round(generated / (sampled - start), 1),
                "rollout_s": round(collected - start, 3),
                "train_s": round(trained - collected, 3),
                "rollout_share": round((collected - start) / (trained - start), 4),
                "mean_reward": round(float(rewards.mean()), 4),
            }
        )
        del rollout
    return row


# -- phases 5 and 6: whole fits through Lightning ---------------------------------------------
def tinymath_demo(results: Results, tiny: bool) -> None:
    """``lightning-troll fit --config configs/tinymath.yaml``, shortened, on this device."""
    import torch

    from lightning_troll.callbacks import RolloutGeneration
    from lightning_troll.cli import run

    rollouts = 2 if tiny else 100
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as logs:
        args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"),
                f"--trainer.accelerator={accelerator}", f"--trainer.max_steps={2 * rollouts}",
                f"--trainer.val_check_interval={rollouts}", f"--trainer.default_root_dir={logs}",
                "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]  # fmt: skip
        if tiny:  # 16 prompts x 8 completions, two minibatches of 64 sequences
            args += ["--data.batch_size=16", "--data.num_val=32", "--data.val_batch_size=32",
                     "--model.optimization.minibatch_size=64"]  # fmt: skip
        start = clock()
        cli = run(args)
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

    from lightning_troll.tinymath import CHARACTERS, SPECIAL_TOKENS, char_tokenizer

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
    from lightning_troll.data import PromptDataModule
    from lightning_troll.module import OptimizationConfig, TrollModule
    from lightning_troll.rewards import REWARD_FUNCTIONS, register_reward
    from lightning_troll.rollout import SamplingConfig

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


WORKERS = {
    "cuda-tests": cuda_tests,
    "fsdp2-nccl": fsdp2_nccl,
    "overhead": overhead,
    "generation": generation,
    "tinymath-demo": tinymath_demo,
    "grpo-smollm2": grpo_smollm2,
}


def work(name: str, path: Path, tiny: bool, fail: bool) -> int:
    """Runs phase ``name`` in this process and records how it ended in ``path``; the exit code."""
    results = Results(path)
    results.write()
    try:
        if fail:
            raise RuntimeError(f"--fail-phase {name}: a failure planted to test the runner")
        WORKERS[name](results, tiny)
    except Skip as reason:
        results.write("skipped", reason=str(reason))
        return 0
    except BaseException as error:  # noqa: BLE001 - recorded, then the exit code says it
        traceback.print_exc()
        results.write("failed", error=f"{type(error).__name__}: {error}")
        return 1
    results.write("ok")
    return 0
