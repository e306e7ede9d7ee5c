"""Memory options: bytes held by the policy, its snapshot and the optimiser, and what a lower-
precision snapshot does to the first minibatch of a rollout.

For two policies, TinyMath (the shipped 642k-parameter demo, 17-token vocabulary) and a tiny
Llama-like model with the Qwen2 vocabulary (151,936 tokens, hidden size 64, 2 layers, tied
embeddings, so the embedding dominates as in small LLMs), and for each snapshot option

    copy float32 | copy bfloat16 | copy int8 | shared | LoRA (r=8, all linear layers)

it prints the bytes of the policy (trainable weights plus frozen base; for LoRA without the
snapshot adapter), of the snapshot, and of the optimiser state after one step with
``torch.optim.AdamW`` and with ``bitsandbytes.optim.AdamW8bit``, and then the statistics of the
first optimiser step of a rollout: mean and max |ratio - 1| over response tokens, and the mean and
max per-token KL(pi_new || pi_old) before the projection ("kl_before"). The policy is the same in
every row and equals the snapshot it was made from, so with an exact snapshot the ratios are 1 and
kl_before is 0; anything else is the snapshot's rounding. All rows score the same completions
(sampled once by the exact copy, 4 prompts x 4 samples, 4 new tokens), so only the snapshot's
precision differs. Bytes count every distinct tensor storage once.

Run (from the repository root, about a minute on 2 CPU cores)::

    python examples/memory_options.py
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import bitsandbytes as bnb
import torch

from lightning_troll.engines.sampling import SamplingConfig, sample
from lightning_troll.models import tiny_causal_lm
from lightning_troll.models.lora import LoraConfig
from lightning_troll.models.snapshots import SnapshotConfig, module_bytes
from lightning_troll.models.tinymath import build_tokenizer
from lightning_troll.rollouts.rollout import Rollout, behaviour_outputs
from lightning_troll.training.module import TrollModule

OPTIONS = {
    "copy float32": {},
    "copy bfloat16": {"snapshot": SnapshotConfig(dtype="bfloat16")},
    "copy int8": {"snapshot": SnapshotConfig(dtype="int8")},
    "shared": {"snapshot": SnapshotConfig(mode="shared")},
    "LoRA r=8": {"lora": LoraConfig(r=8)},
}
PROMPTS = ["12+7=", "3*4=", "45-9=", "8+80="]
GROUP = 4
SAMPLING = SamplingConfig(max_new_tokens=4)


def qwen_like_dir(vocab_size: int) -> str:
    """A tiny Llama-like model with a large vocabulary and the TinyMath tokenizer, saved."""
    path = tempfile.mkdtemp(prefix="memory_options_")
    tokenizer = build_tokenizer()
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": tokenizer.eos_token_id}
    model = tiny_causal_lm(vocab_size, hidden_size=64, num_layers=2, num_heads=2, **ids)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make(model: str, options: dict) -> TrollModule:
    return TrollModule(model=model, group_size=GROUP, sampling=SAMPLING, **options)


def optimiser_bytes(module: TrollModule, factory) -> int:
    """Bytes of the optimiser state after one step on the gradients already in place."""
    params = [p for p in module.policy.parameters() if p.requires_grad]
    optimizer = factory(params)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return module_bytes(iter(state))


def rollout_for(module: TrollModule, sequences: tuple) -> Rollout:
    """The completions scored by ``module``'s snapshot, as the first minibatch sees them."""
    input_ids, attention_mask, response_mask, truncated = sequences
    with module.policies.behaviour() as snapshot:
        old_logprobs, old = behaviour_outputs(
            snapshot, input_ids, attention_mask, response_mask, 1.0, module.old_rows.sparsify
        )
    rewards = torch.arange(len(input_ids), dtype=torch.float32) % 3  # (B,) any spread will do
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        old=old,
        rewards=rewards,
        advantages=module.global_batch.advantages(rewards),
        truncated=truncated,
        temperature=1.0,
        group_size=GROUP,
    )


def measure(model: str, label: str, options: dict, sequences: tuple) -> dict:
    module = make(model, options)
    snapshot = module.snapshot.nbytes
    everything = [*module.policy.parameters(), *module.policy.buffers()]
    policy = module_bytes(iter(everything)) - (snapshot if module.snapshot.shares_policy else 0)
    loss, stats = module.loss_of(rollout_for(module, sequences))
    loss.backward()
    adamw = optimiser_bytes(module, lambda p: torch.optim.AdamW(p, lr=1e-4))
    adamw8 = optimiser_bytes(module, lambda p: bnb.optim.AdamW8bit(p, lr=1e-4))
    gap = (stats.token_ratio - 1).abs()
    kl = stats.projection.kl_before
    return {
        "option": label,
        "policy": policy,
        "snapshot": snapshot,
        "adamw": adamw,
        "adamw8bit": adamw8,
        "ratio_gap_mean": float(gap.mean()),
        "ratio_gap_max": float(gap.max()),
        "kl_before_mean": float(kl.mean()),
        "kl_before_max": float(kl.max()),
    }


def mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n")
    print(
        "| option | policy MB | snapshot MB | AdamW state MB | AdamW8bit state MB "
        "| total MB (AdamW) | mean abs(r-1) | max abs(r-1) | kl_before mean | kl_before max |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        total = r["policy"] + r["snapshot"] + r["adamw"]
        print(
            f"| {r['option']} | {mb(r['policy'])} | {mb(r['snapshot'])} | {mb(r['adamw'])} "
            f"| {mb(r['adamw8bit'])} | {mb(total)} | {r['ratio_gap_mean']:.2e} "
            f"| {r['ratio_gap_max']:.2e} | {r['kl_before_mean']:.2e} | {r['kl_before_max']:.2e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary of the 2nd model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    for title, model in (
        ("TinyMath (642k parameters, V = 17)", "tinymath"),
        (f"tiny Llama-like model (V = {args.vocab:,}, hidden 64, 2 layers)", None),
    ):
        model = model or qwen_like_dir(args.vocab)
        exact = make(model, {})
        prompts = [exact.tokenizer(p)["input_ids"] for p in PROMPTS]
        sequences = sample(exact.old_policy, prompts, GROUP, SAMPLING, exact.pad_id, exact.eos_id)
        rows = [measure(model, label, options, sequences) for label, options in OPTIONS.items()]
        print_table(title, rows)


if __name__ == "__main__":
    main()
