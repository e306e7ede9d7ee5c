"""Teacher-forced passes with shared prompts: the same hidden states and gradients as whole
sequences, the distinct prompts by hand, and the cases that run whole sequences instead."""

from __future__ import annotations

import pytest
import torch

from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.rollouts.forward import distinct_prompts, response_hidden
from lightning_troll.training.module import EngineConfig

G, S, T, VOCAB = 3, 6, 5, 40


def batch(prompts: int = 2):
    """``prompts`` distinct prompts (the first left padded by 2) x G responses of varied length."""
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (prompts, S))
    prompt_mask = torch.ones(prompts, S, dtype=torch.long)
    prompt_ids[0, :2], prompt_mask[0, :2] = 0, 0
    responses = torch.randint(3, VOCAB, (prompts * G, T))
    response_mask = torch.ones(prompts * G, T, dtype=torch.long)
    for row, length in enumerate(torch.randint(1, T + 1, (prompts * G,)).tolist()):
        responses[row, length:], response_mask[row, length:] = 0, 0
    ids = torch.cat([prompt_ids.repeat_interleave(G, 0), responses], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), response_mask], 1)
    return ids, mask, response_mask.bool()


@pytest.fixture(scope="module")
def model():
    m = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, seed=0)
    return m.double().train()


def hidden_and_grads(model, ids, mask, response, share, order=None):
    if order is not None:  # shuffled sequences, as minibatches hold them
        ids, mask, response = ids[order], mask[order], response[order]
    hidden = response_hidden(model, ids, mask, T, share_prompts=share)
    weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
    loss = (hidden[response] * weights).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return hidden, grads


@pytest.mark.parametrize("order", [None, [4, 0, 5, 2, 1, 3]], ids=["grouped", "shuffled"])
def test_shared_prompts_give_the_hidden_states_and_gradients_of_whole_sequences(model, order):
    """float64, but the model's rotary tables are float32: hidden states at response tokens agree
    to 1e-6 relative, every gradient to 1e-7 of its largest entry (float32's rounding; a gradient
    path lost through the cache would be off by far more)."""
    ids, mask, response = batch()
    order = None if order is None else torch.tensor(order)
    whole, whole_grads = hidden_and_grads(model, ids, mask, response, False, order)
    shared, shared_grads = hidden_and_grads(model, ids, mask, response, True, order)
    response = response if order is None else response[order]
    assert shared.shape == whole.shape == (2 * G, T, 16)
    torch.testing.assert_close(shared[response], whole[response], rtol=1e-6, atol=1e-8)
    for a, b in zip(shared_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7 * float(b.abs().max()))


def test_the_prompt_pass_runs_once_per_distinct_prompt(model):
    ids, mask, _ = batch()
    sizes = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            response_hidden(model, ids, mask, T, share_prompts=True)
    finally:
        handle.remove()
    assert sizes == [(2, S), (2 * G, T)]  # the prompts once each, then every response


def test_distinct_prompts_by_hand():
    """Rows 0 and 2 share a prompt, row 1 has the same ids under another mask, row 3 its own:
    three distinct prompts, first seen at rows 0, 1 and 3."""
    ids = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 9], [0, 5, 6, 8], [7, 7, 6, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    first, inverse = distinct_prompts(ids, mask, prompt_length=3)
    assert sorted(first.tolist()) == [0, 1, 3]
    assert inverse[0] == inverse[2] and len(set(inverse.tolist())) == 3
    assert torch.equal(ids[first[inverse], :3], ids[:, :3])  # every row maps to its prompt


def count_passes(model):
    """Batch sizes of the decoder's calls, in order (kept in a list the caller reads)."""
    calls: list[int] = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return calls, handle


def test_whole_sequences_run_when_no_prompt_repeats():
    ids, mask, _ = batch(prompts=1)
    model = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2).train()
    calls, handle = count_passes(model)
    try:
        response_hidden(model, ids[:1], mask[:1], T, share_prompts=True)  # one sequence
    finally:
        handle.remove()
    assert calls == [1]  # one whole pass, no prompt pass


@pytest.mark.parametrize("order", [None, [4, 0, 5, 2, 1, 3]], ids=["grouped", "shuffled"])
def test_shared_prompts_under_checkpointing_give_the_gradients_of_whole_sequences(order):
    """Gradient checkpointing replays each layer in the backward pass: the prompt pass once per
    distinct prompt, the responses against its cache, and every layer replayed, with the hidden
    states and gradients of whole sequences without checkpointing."""
    ids, mask, response = batch()
    order = None if order is None else torch.tensor(order)
    model = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, seed=0)
    model = model.double().train()
    whole, whole_grads = hidden_and_grads(model, ids, mask, response, False, order)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    replays: list[int] = []
    mlp = model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: replays.append(1))
    calls, handle = count_passes(model)
    try:
        shared, shared_grads = hidden_and_grads(model, ids, mask, response, True, order)
    finally:
        handle.remove()
        mlp.remove()
    assert calls == [2, 2 * G]  # the prompts once each, then every response
    assert len(replays) == 4  # two passes, each replayed in the backward pass
    response = response if order is None else response[order]
    torch.testing.assert_close(shared[response], whole[response], rtol=1e-6, atol=1e-8)
    for a, b in zip(shared_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7 * float(b.abs().max()))
    assert all("_can_checkpoint_with_cache" not in layer.__dict__ for layer in model.model.layers)


def test_checkpointed_layers_that_cannot_keep_a_cache_run_whole_sequences(monkeypatch):
    from lightning_troll.rollouts import forward

    ids, mask, _ = batch()
    model = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert forward.checkpointed_layers(model) == list(model.model.layers)
    monkeypatch.setattr(forward, "checkpointed_layers", lambda model: None)
    calls, handle = count_passes(model)
    try:
        response_hidden(model, ids, mask, T, share_prompts=True)
    finally:
        handle.remove()
    assert calls == [2 * G]  # one whole pass


def test_a_cache_the_layers_dropped_is_refused_not_read(monkeypatch):
    """Were the checkpointed layers to drop the prompt's cache, the responses would run without
    their prompt: that is an error naming the way out, never wrong hidden states."""
    import contextlib

    from lightning_troll.rollouts import forward

    ids, mask, _ = batch()
    model = tiny_causal_lm(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    monkeypatch.setattr(forward, "caches_kept", lambda layers: contextlib.nullcontext())
    with pytest.raises(
        RuntimeError, match="0 of 6 positions; set model.optimization.share_prompts=false"
    ):
        response_hidden(model, ids, mask, T, share_prompts=True)


def test_a_sliding_window_model_keeps_whole_sequences_under_checkpointing():
    from transformers import MistralConfig, MistralForCausalLM

    from lightning_troll.rollouts.prompt_cache import checkpointed_layers

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
    )  # fmt: skip
    model = MistralForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(model) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("behaviour", "checkpointing"),
    [("sampling", False), ("forward", False), ("sampling", True)],
)
def test_training_with_shared_prompts_takes_the_same_steps(
    tmp_path, tiny_model_dir, behaviour, checkpointing
):
    """Two rollouts of two off-policy steps each (shuffled minibatches of 8 of 16 sequences):
    the same losses and weights, to float32 rounding, with and without shared prompts (and
    with gradient checkpointing on both)."""
    from lightning_troll.training.module import OptimizationConfig
    from tests.test_training import fit, make_module, sgd

    weights, losses = [], []
    for share in (False, True):
        module = make_module(
            tiny_model_dir,
            optimizer=sgd(0.5),
            engine=EngineConfig(behaviour_logprobs=behaviour),
            optimization=OptimizationConfig(
                minibatch_size=8,
                micro_batch_size=4,
                share_prompts=share,
                gradient_checkpointing=checkpointing,
            ),
        )
        _, _, recorder = fit(tmp_path / str(share), tiny_model_dir, max_steps=4, module=module,
                             limit_val_batches=0)  # fmt: skip
        weights.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
        losses.append(torch.stack([s.policy_loss for steps in recorder.stats for s in steps]))
    assert losses[0].shape == (8,)  # 2 rollouts x 2 minibatches x 2 micro-batches
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-5)
    assert not torch.equal(
        weights[0],
        torch.cat([p.detach().flatten() for p in make_module(tiny_model_dir).policy.parameters()]),
    )
