"""Micro-batches by a token budget and the packed (padding-free) forward: the parts by hand, the
columns a part keeps, and the packed loss, gradients and teacher-forced passes equal to the padded
ones in float64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.objectives import build_objective
from lightning_troll.rollouts.forward import behaviour_outputs, response_hidden
from lightning_troll.rollouts.micro_batches import (
    FALLBACK_TOKENS,
    activation_bytes,
    consecutive_parts,
    lengths_of,
    part_cost,
    resolve_tokens,
    split_to,
    token_parts,
    used_columns,
)
from lightning_troll.rollouts.packing import packs
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.training.optimization import OptimizationConfig
from lightning_troll.training.policies import policy_loss
from lightning_troll.trust_region.sparse import sparsify

VOCAB, S, T = 40, 6, 7


def masks(prompts: list[int], responses: list[int]) -> torch.Tensor:
    """(B, S + T) attention masks: each prompt left padded to S, each response right padded."""
    rows = []
    for p, r in zip(prompts, responses, strict=True):
        rows.append([0] * (S - p) + [1] * p + [1] * r + [0] * (T - r))
    return torch.tensor(rows)


def test_lengths_and_the_columns_a_part_uses():
    mask = masks([2, 6, 4], [7, 1, 3])
    prompt, response = lengths_of(mask, S)
    assert prompt.tolist() == [2, 6, 4] and response.tolist() == [7, 1, 3]
    assert used_columns(mask[[0, 2]], S) == (2, 7)  # the longest prompt is 4: columns 2..
    assert used_columns(mask[[1, 2]], S) == (0, 3)


def test_part_costs_by_hand():
    """Padded: 2 rows x (longest prompt 6 + longest response 3) = 18; packed: 7 + 7 = 14."""
    prompt, response = torch.tensor([6, 4]), torch.tensor([1, 3])
    assert part_cost(prompt, response, packed=False) == 18
    assert part_cost(prompt, response, packed=True) == 14


def test_token_parts_fill_longest_first_within_the_budget():
    """Totals 9, 7, 7, 3, 2 (rows 0, 1, 2, 3, 4). Budget 16, padded: row 0 (9) opens a part;
    row 1 would make it 2 x (6 + 7) = 26 > 16, so it opens the next; row 2 would make that
    2 x (6 + 3) = 18, so it opens a third, which row 3 joins (2 x (4 + 3) = 14); row 4 would
    make it 3 x 7 = 21 and goes alone."""
    mask = masks([2, 6, 4, 2, 1], [7, 1, 3, 1, 1])
    parts = token_parts(mask, S, max_tokens=16)
    assert [p.tolist() for p in parts] == [[0], [1], [2, 3], [4]]
    # packed, a part costs its real tokens: 9 + 7 = 16 fits, then 7 + 3 + 2 = 12
    packed = token_parts(mask, S, max_tokens=16, packed=True)
    assert [p.tolist() for p in packed] == [[0, 1], [2, 3, 4]]
    # micro_batch_size caps the sequences of a part as well
    capped = token_parts(mask, S, max_tokens=16, max_sequences=1, packed=True)
    assert [p.tolist() for p in capped] == [[0], [1], [2], [3], [4]]
    # a sequence over the budget goes alone; no budget: consecutive parts of max_sequences
    alone = [[0], [1], [2], [3], [4]]  # row 4 with row 3: 2 x (2 + 1) = 6 > 4
    assert [p.tolist() for p in token_parts(mask, S, max_tokens=4)] == alone
    assert [p.tolist() for p in token_parts(mask, S, None, 2)] == [[0, 1], [2, 3], [4]]
    assert [p.tolist() for p in token_parts(mask, S, None)] == [[0, 1, 2, 3, 4]]


def test_consecutive_parts_keep_the_order():
    """In order, budget 16: row 0 (9); rows 0-1 would cost 2 x 13; rows 1-2 2 x 9; rows 2-3
    2 x 7 = 14 fit; rows 2-4 3 x 7 = 21 do not. Packed: 9 + 7 = 16 fit, then 7 + 3 + 2."""
    mask = masks([2, 6, 4, 2, 1], [7, 1, 3, 1, 1])
    ranges = consecutive_parts(mask, S, max_tokens=16)
    assert ranges == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 5)]
    assert consecutive_parts(mask, S, None) == [slice(0, 5)]
    assert consecutive_parts(mask, S, 16, packed=True) == [slice(0, 2), slice(2, 5)]


def test_split_to_halves_the_costliest_part():
    parts = [torch.tensor([0, 1, 2, 3]), torch.tensor([4])]
    split = split_to(parts, 3, costs=[40, 50])  # [4] cannot be split: the 4 rows are halved
    assert [p.tolist() for p in split] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="cannot make 6 micro-batches of 5 sequences"):
        split_to(parts, 6, costs=[40, 50])


def test_the_option_is_checked():
    for bad in (0, -5, "many", 1.5, True):
        with pytest.raises(
            ValueError, match=r"micro_batch_tokens must be auto, null or an integer"
        ):
            OptimizationConfig(micro_batch_tokens=bad)
    assert OptimizationConfig(micro_batch_tokens=None).micro_batch_tokens is None
    assert OptimizationConfig().micro_batch_tokens == "auto"


def test_auto_fills_the_device_s_activation_budget():
    """A tiny Llama of 2 layers, hidden 16, MLP width 64, float32 keeps 2 x (16 x 16 + 4 x 64)
    x 4 = 4,096 bytes a token: 2 GiB of them on a CPU is 524,288 tokens; in float64 twice the
    bytes, half the tokens. SmolLM2-135M's shape (30 layers, 576, 1,536) in float32: 1,843,200
    bytes, 1,165 tokens."""
    model = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2)
    assert activation_bytes(model) == 4096
    assert resolve_tokens("auto", model) == 2 * 2**30 // 4096 == 524288
    assert resolve_tokens("auto", model.double()) == 262144
    assert resolve_tokens(300, model) == 300 and resolve_tokens(None, model) is None
    smollm2 = torch.nn.Linear(1, 1)  # SmolLM2-135M's config, without its weights
    smollm2.config = SimpleNamespace(num_hidden_layers=30, hidden_size=576, intermediate_size=1536)
    assert activation_bytes(smollm2) == 1843200 and resolve_tokens("auto", smollm2) == 1165
    assert resolve_tokens("auto", torch.nn.Linear(2, 2)) == FALLBACK_TOKENS


# -- the packed forward -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    m = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, seed=0)
    return m.double().train()


def ragged(seed: int = 1):
    """Six sequences: two prompts (one left padded by 2) x 3 responses of lengths 1 to T."""
    g = torch.Generator().manual_seed(seed)
    mask = masks([4, 4, 4, 6, 6, 6], [7, 1, 3, 5, 2, 6])
    ids = torch.randint(3, VOCAB, mask.shape, generator=g).masked_fill(mask == 0, 0)
    ids[3:, :S] = ids[3, :S]  # a group shares its prompt
    ids[:3, :S] = ids[0, :S]
    return ids, mask, mask[:, S:].bool()


def test_only_models_built_on_transformers_masks_pack(model):
    assert packs(model)
    assert not packs(torch.nn.Linear(2, 2))


def test_packed_hidden_states_and_gradients_equal_the_padded_ones(model):
    """float64 (rotary tables float32): hidden states at response tokens to 1e-6 relative, every
    gradient to 1e-7 of its largest entry; the packed forward sees 6 real sequences in one row."""
    ids, mask, response = ragged()
    sizes = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    results = []
    try:
        for packed in (False, True):
            hidden = response_hidden(model, ids, mask, T, packed=packed)
            weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
            loss = (hidden[response] * weights).sum()
            results.append((hidden, torch.autograd.grad(loss, list(model.parameters()))))
    finally:
        hook.remove()
    assert sizes == [(6, S + T), (1, int(mask.sum()))]
    (padded, padded_grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed[response], padded[response], rtol=1e-6, atol=1e-8)
    assert packed[~response].abs().max() == 0  # zeros at padding
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7 * float(b.abs().max()))


def rollout_of(model, ids, mask, response) -> Rollout:
    """A rollout whose old policy is a perturbed copy of ``model`` (so the ratio moves)."""
    rows = lambda logits, tokens: sparsify(logits, 8, 1e-5, keep=tokens)  # noqa: E731
    with torch.no_grad():
        logprobs, old = behaviour_outputs(model, ids, mask, response, 1.0, rows, chunk_size=4)
    return Rollout(
        input_ids=ids, attention_mask=mask, response_mask=response,
        old_logprobs=logprobs - 0.05 * torch.arange(T).double() * response, old=old,
        rewards=torch.linspace(0, 1, 6).double(), advantages=torch.linspace(-1, 1, 6).double(),
        truncated=torch.zeros(6, dtype=torch.bool), temperature=1.0, group_size=3,
    )  # fmt: skip


@pytest.mark.parametrize("objective", ["troll", "clip"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_the_packed_loss_equals_the_padded_loss(model, objective, chunk_size):
    """The objective's loss and gradients on a ragged rollout, packed or padded, trimmed or not:
    equal to float64 rounding (the projection's root finder converges to 1e-10)."""
    ids, mask, response = ragged()
    rollout = rollout_of(model, ids, mask, response)
    loss_fn = build_objective(objective)
    policies = SimpleNamespace(policy=model)
    results = []
    for packed, part in (
        (False, rollout),
        (True, rollout),
        (True, rollout.select(torch.arange(3)).trimmed()),
    ):
        loss, _ = policy_loss(policies, loss_fn, part, chunk_size, False, packed)
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (padded, padded_grads), (packed, packed_grads), (trimmed, _) = results
    torch.testing.assert_close(packed, padded, rtol=1e-8, atol=1e-10)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7 * float(b.abs().max()))
    alone, _ = policy_loss(policies, loss_fn, rollout.select(torch.arange(3)), chunk_size, False)
    torch.testing.assert_close(trimmed, alone, rtol=1e-8, atol=1e-10)


def test_teacher_forced_passes_in_parts_equal_one_pass(model):
    """Log-probs and sparse rows of the behaviour pass in consecutive parts of at most 20 tokens,
    padded or packed, equal one pass over all six sequences."""
    ids, mask, response = ragged()
    rows = lambda logits, tokens: sparsify(logits, 8, 1e-5, keep=tokens)  # noqa: E731
    with torch.no_grad():
        whole, whole_old = behaviour_outputs(model, ids, mask, response, 0.7, rows, 4)
        for packed in (False, True):
            logp, old = behaviour_outputs(
                model, ids, mask, response, 0.7, rows, 4, False, 20, packed
            )
            assert len(consecutive_parts(mask, S, 20, packed)) > 1
            torch.testing.assert_close(logp, whole, rtol=1e-6, atol=1e-9)
            assert old.num_rows == whole_old.num_rows == int(response.sum())
            assert torch.equal(old.sizes, whole_old.sizes)
            k = int(whole_old.sizes.max())  # parts pad their rows to their own largest support
            assert torch.equal(old.indices[:, :k], whole_old.indices[:, :k])
            torch.testing.assert_close(old.logprobs[:, :k], whole_old.logprobs[:, :k])
            torch.testing.assert_close(old.tail_logmass, whole_old.tail_logmass)


def test_a_sharded_pass_runs_as_many_parts_on_every_process(monkeypatch):
    """Under FSDP2 every process must run as many forwards: with another process needing 4
    parts, one range of 5 sequences is halved longest first into (0-1, 1-2, 2-3, 3-5); unsharded,
    the ranges stay as they are."""
    import lightning_troll.rollouts.micro_batches as micro

    model = torch.nn.Linear(1, 1)
    assert micro.as_many_as_every_process([slice(0, 5)], model) == [slice(0, 5)]
    monkeypatch.setattr(micro, "is_sharded", lambda m: True)
    monkeypatch.setattr(micro.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(micro.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(micro.dist, "all_reduce", lambda t, op: t.fill_(4))
    split = micro.as_many_as_every_process([slice(0, 5)], model)
    assert split == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 5)]
    with pytest.raises(ValueError, match="cannot make 4 passes of 2 sequences"):
        micro.as_many_as_every_process([slice(0, 1), slice(1, 2)], model)
