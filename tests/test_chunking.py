"""Chunked log-probs: the output layer applied to a few response tokens at a time gives what the
full (tokens x vocabulary) logits give, for the cached behaviour outputs and for the loss and its
gradients; the chunked forward holds no vocabulary-sized tensor; soft-capped models fall back."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.objectives import LossInputs, build_objective
from lightning_troll.objectives.chunking import check_chunk_size, row_chunks
from lightning_troll.rollouts import forward as forward_module
from lightning_troll.rollouts.rollout import (
    behaviour_outputs,
    linear_head,
    response_hidden,
    response_logits,
)
from lightning_troll.training.module import OptimizationConfig, TrollModule
from lightning_troll.trust_region.sparse import sparsify

V, H = 61, 16  # vocabulary and hidden size of the test models (V != H, V != any other size)
S, T = 3, 6  # prompt and response length
PROMPT_LENGTHS = [3, 2, 3, 1, 3]
RESPONSE_LENGTHS = [6, 4, 0, 5, 3]  # N = 18 response tokens; one sequence is empty
N = sum(RESPONSE_LENGTHS)
TEMPERATURE = 0.7


def llama(seed: int) -> nn.Module:
    return tiny_causal_lm(V, hidden_size=H, num_layers=1, num_heads=2, seed=seed).double()


def batch(vocab: int = V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts and right-padded responses: ids, attention mask, response mask."""
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(S + T)
    prompt, response = torch.tensor(PROMPT_LENGTHS), torch.tensor(RESPONSE_LENGTHS)
    attention = (positions >= S - prompt[:, None]) & (positions < S + response[:, None])
    ids = torch.randint(1, vocab, (len(PROMPT_LENGTHS), S + T), generator=g)
    return ids.masked_fill(~attention, 0), attention.long(), attention[:, S:]


def sparse_old(rows: torch.Tensor, tokens: torch.Tensor):
    return sparsify(rows, max_tokens=5, mass_delta=1e-3, keep=tokens)


def test_row_chunks_cover_the_rows_in_order():
    assert row_chunks(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert row_chunks(10, None) == [slice(0, 10)]
    assert row_chunks(3, 4) == [slice(0, 3)]
    assert row_chunks(0, 4) == [slice(0, 0)]  # an empty batch is one empty chunk


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "8"])
def test_bad_chunk_size_is_refused(bad):
    message = f"chunk_size must be null (no chunks) or an integer >= 1; got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_chunk_size(bad, "chunk_size")


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
def test_behaviour_outputs_in_chunks_equal_the_full_logits(chunk_size):
    model = llama(seed=0)
    ids, attention, response = batch()
    full_logp, full = behaviour_outputs(model, ids, attention, response, TEMPERATURE, sparse_old)
    logp, old = behaviour_outputs(
        model, ids, attention, response, TEMPERATURE, sparse_old, chunk_size
    )
    assert N % chunk_size != 0 or chunk_size == 1  # a last, partial chunk where there are chunks
    assert full.num_rows == old.num_rows == N and full.indices.shape == old.indices.shape
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)  # float32 log-probs
    assert bool((logp[~response] == 0).all())
    assert torch.equal(old.indices, full.indices)
    torch.testing.assert_close(old.logprobs, full.logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(old.tail_logmass, full.tail_logmass, rtol=1e-10, atol=0)


def test_non_finite_logits_are_reported_across_chunks():
    model = llama(seed=0)
    ids, attention, response = batch()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    message = rf"logits hold NaN or \+inf \(or -inf at the sampled token\) at {N} response tokens \(first: sequence 0, position 0\)"
    with pytest.raises(FloatingPointError, match=message):
        behaviour_outputs(model, ids, attention, response, 1.0, sparse_old, 4)


class MaskedVocabulary(nn.Module):
    """A model whose logits are -inf at the tokens ``masked`` (a vocabulary masked at sampling),
    and optionally NaN or +inf at one entry."""

    def __init__(self, model: nn.Module, masked: slice, poison: float | None = None) -> None:
        super().__init__()
        self.model, self.masked, self.poison = model, masked, poison

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        logits = out.logits.clone()
        logits[..., self.masked] = float("-inf")
        if self.poison is not None:
            logits[0, -2, 0] = self.poison  # predicts sequence 0's last response token
        out.logits = logits
        return out


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_minus_inf_logits_are_accepted_nan_and_plus_inf_refused(poison):
    """-inf outside the sampled tokens passes the rollout check and gives the log-probs and
    sparse rows of the unmasked tokens; NaN or +inf anywhere in a row is refused."""
    model = llama(seed=0)
    ids, attention, response = batch(vocab=40)  # sampled tokens below 40, masked 40..60
    masked = MaskedVocabulary(model, slice(40, None), poison)
    if poison is not None:
        with pytest.raises(FloatingPointError, match=r"NaN or \+inf .* at 1 response tokens"):
            behaviour_outputs(masked, ids, attention, response, TEMPERATURE, sparse_old, None)
        return
    logp, old = behaviour_outputs(masked, ids, attention, response, TEMPERATURE, sparse_old, None)
    full = response_logits(model, ids, attention, T, TEMPERATURE)[response]  # (N, V)
    expected = full[:, :40].log_softmax(-1).gather(-1, ids[:, S:][response][:, None])
    expected = expected.squeeze(-1).float()  # the cached log-probs are float32
    torch.testing.assert_close(logp[response], expected, rtol=0, atol=1e-6)
    assert torch.isfinite(old.tail_logmass).all() and (old.indices < 40).all()
    assert torch.isfinite(old.logprobs[old.indices >= 0]).all()


def test_minus_inf_at_the_sampled_token_is_refused():
    model = llama(seed=0)
    ids, attention, response = batch()
    token = int(ids[0, S])  # sequence 0's first response token
    masked = MaskedVocabulary(model, slice(token, token + 1))
    with pytest.raises(FloatingPointError, match=r"first: sequence 0, position 0"):
        behaviour_outputs(masked, ids, attention, response, TEMPERATURE, sparse_old, None)


def _loss_and_grads(objective, model, inputs, targets, chunk_size):
    """Loss, statistics and parameter gradients from the full logits (chunk_size "full") or
    from the hidden states in chunks."""
    model.zero_grad(set_to_none=True)
    if chunk_size == "full":
        logits = response_logits(model, *inputs, T, TEMPERATURE)  # (B, T, V)
        loss, stats = objective(logits, targets)
    else:
        hidden = response_hidden(model, *inputs, T)  # (B, T, H)
        head = linear_head(model)
        loss, stats = objective.forward_hidden(
            hidden, head, TEMPERATURE, targets, chunk_size=chunk_size
        )
    loss.backward()
    return loss.detach(), stats, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk_size", [4, None])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("name", ["troll", "clip"])
def test_chunked_loss_and_gradients_equal_the_full_logits(name, importance, chunk_size):
    policy, behaviour, reference = llama(seed=0), llama(seed=1), llama(seed=2)
    ids, attention, response = batch()
    inputs = (ids, attention)
    old_logprobs, old = behaviour_outputs(behaviour, *inputs, response, TEMPERATURE, sparse_old)
    ref_logprobs, _ = behaviour_outputs(reference, *inputs, response, TEMPERATURE, None)
    advantages = torch.randn(len(PROMPT_LENGTHS), generator=torch.Generator().manual_seed(1))
    targets = LossInputs(
        tokens=ids[:, S:],
        mask=response,
        advantages=advantages.double(),
        old_logprobs=old_logprobs,
        old=old,
        ref_logprobs=ref_logprobs,
    )
    specific = {"eps": 0.0042, "max_tokens": 5, "mass_delta": 1e-3} if name == "troll" else {}
    objective = build_objective(
        name,
        importance=importance,
        aggregation="seq_mean_token_mean",
        entropy_coef=0.01,
        ref_kl_coef=0.1,
        **specific,
    )
    loss, stats, grads = _loss_and_grads(objective, policy, inputs, targets, "full")
    c_loss, c_stats, c_grads = _loss_and_grads(objective, policy, inputs, targets, chunk_size)

    torch.testing.assert_close(c_loss, loss, rtol=1e-10, atol=0)
    for c_grad, grad in zip(c_grads, grads, strict=True):
        assert grad.abs().max() > 0
        torch.testing.assert_close(c_grad, grad, rtol=1e-9, atol=1e-12)
    for field in ("policy_loss", "regression_loss", "ref_kl", "entropy", "token_ratio"):
        torch.testing.assert_close(
            getattr(c_stats, field), getattr(stats, field), rtol=1e-10, atol=0
        )
    assert stats.entropy > 0 and stats.ref_kl != 0
    if name == "troll":
        assert 0 < stats.active_frac < 1  # some tokens projected, some not
        assert c_stats.active_frac == stats.active_frac
        for field in ("eta", "kl_before", "kl_after", "support_size"):
            full, chunked = getattr(stats.projection, field), getattr(c_stats.projection, field)
            torch.testing.assert_close(chunked, full, rtol=1e-9, atol=1e-12)


def _vocab_sized_saves(run) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd keeps for the backward pass of ``run()`` whose last
    dimension is the vocabulary."""
    shapes = []

    def pack(t):
        if t.dim() and t.shape[-1] == V:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run().backward()
    return shapes


@pytest.mark.parametrize("name", ["troll", "clip"])
def test_chunked_forward_keeps_no_vocabulary_sized_tensor(name):
    g = torch.Generator().manual_seed(0)
    _, _, response = batch()
    head = nn.Linear(H, V, bias=False).double()
    hidden = torch.randn(len(PROMPT_LENGTHS), T, H, generator=g, dtype=torch.float64)
    old_logits = torch.randn(len(PROMPT_LENGTHS), T, V, generator=g, dtype=torch.float64)
    tokens = old_logits.argmax(-1)
    old_logprobs = old_logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    old = sparse_old(old_logits[response], tokens[response])
    advantages = torch.ones(len(PROMPT_LENGTHS))
    targets = LossInputs(
        tokens=tokens, mask=response, advantages=advantages, old_logprobs=old_logprobs, old=old
    )
    objective = build_objective(name, entropy_coef=0.01)
    h = hidden.requires_grad_()

    full = _vocab_sized_saves(lambda: objective(head(h) / TEMPERATURE, targets)[0])
    assert (N, V) in full  # the control: the full path keeps (N, V) buffers
    chunked = _vocab_sized_saves(
        lambda: objective.forward_hidden(h, head, TEMPERATURE, targets, chunk_size=4)[0]
    )
    assert chunked == []


def _troll_case(support: str):
    """A chunked TROLL loss case: policy, inputs, targets, and the objective."""
    policy, behaviour = llama(seed=0), llama(seed=1)
    ids, attention, response = batch()
    old_logprobs, old = behaviour_outputs(
        behaviour, ids, attention, response, TEMPERATURE, sparse_old
    )
    targets = LossInputs(
        tokens=ids[:, S:],
        mask=response,
        advantages=torch.randn(
            len(PROMPT_LENGTHS), generator=torch.Generator().manual_seed(1)
        ).double(),
        old_logprobs=old_logprobs,
        old=old,
    )
    objective = build_objective("troll", eps=0.0042, max_tokens=5, mass_delta=1e-3, support=support)
    return policy, (ids, attention), targets, objective


@pytest.mark.parametrize("support", ["official", "union"])
def test_troll_checks_the_token_values_once_a_call_not_once_a_chunk(support, monkeypatch):
    """The token ids are read on the device once per loss, not in each of the 5 chunks and again
    in each chunk's recomputation in the backward pass; each chunk's projection skips them."""
    policy, inputs, targets, objective = _troll_case(support)
    checks, projected = [], []
    check = objective.projection.check_tokens
    monkeypatch.setattr(
        objective.projection, "check_tokens", lambda *a: (checks.append(a[0].shape), check(*a))
    )
    forward = objective.projection.forward

    def spy(*args, **kwargs):
        projected.append(kwargs.get("check_values", True))
        return forward(*args, **kwargs)

    monkeypatch.setattr(objective.projection, "forward", spy)
    loss, stats, grads = _loss_and_grads(objective, policy, inputs, targets, 4)
    assert checks == [(N,)]  # once, on all N response tokens
    assert projected == [False] * 10  # 5 chunks of 4 rows, each recomputed for the backward
    assert 0 < stats.active_frac < 1 and all(g.isfinite().all() for g in grads)


def test_the_recomputed_chunks_take_eta_from_the_forward_pass(monkeypatch):
    """Under checkpointing the backward pass recomputes each chunk; the root finder runs in the
    forward pass only, and the loss and every gradient equal, bit for bit, those of recomputing
    eta* as well."""
    from contextlib import nullcontext

    import lightning_troll.trust_region.kl_solver as kl_solver
    from lightning_troll.objectives import chunking

    policy, inputs, targets, objective = _troll_case("official")
    solves = []
    solve = kl_solver.solve_eta
    monkeypatch.setattr(kl_solver, "solve_eta", lambda *a: (solves.append(1), solve(*a))[1])
    loss, stats, grads = _loss_and_grads(objective, policy, inputs, targets, 4)
    replayed_solves = len(solves)

    class Recompute:  # no replay: the recomputation solves again
        def contexts(self):
            return nullcontext(), nullcontext()

    monkeypatch.setattr(chunking, "Replay", Recompute)
    solves.clear()
    loss_2, stats_2, grads_2 = _loss_and_grads(objective, policy, inputs, targets, 4)
    assert 0 < stats.active_frac < 1
    assert 1 <= replayed_solves <= 5  # at most once per chunk of 4 of the N = 18 rows
    assert len(solves) == 2 * replayed_solves
    assert torch.equal(loss, loss_2)
    assert all(torch.equal(g, g_2) for g, g_2 in zip(grads, grads_2, strict=True))
    assert torch.equal(stats.projection.eta, stats_2.projection.eta)


class _Waits(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that make the host wait on a GPU: scalar reads, nonzero, and
    indexing with a boolean mask (which runs a nonzero)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        boolean = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if boolean or name in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.calls.append("boolean index" if boolean else name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["clip", "troll"])
def test_the_loss_finds_the_response_tokens_once_and_its_backward_never_waits(name):
    """One nonzero finds the N response tokens; no boolean mask indexes a tensor; clipping's loss
    reads no scalar; TROLL's backward pass (which recomputes its 5 chunks) reads none either."""
    policy, inputs, targets, objective = _troll_case("official")
    if name == "clip":
        objective = build_objective("clip")
    hidden = response_hidden(policy, *inputs, T)
    head = linear_head(policy)
    with _Waits() as forward:
        loss, stats = objective.forward_hidden(hidden, head, TEMPERATURE, targets, chunk_size=4)
    with _Waits() as backward:
        loss.backward()
    assert forward.calls.count("nonzero") == 1 and "boolean index" not in forward.calls
    assert backward.calls == []
    if name == "clip":
        assert forward.calls == ["nonzero"]
    else:  # the token check, then per chunk the row counts and the root finder's checks
        assert stats.active_frac > 0 and forward.calls.count("_local_scalar_dense") >= 6


def test_replay_records_once_and_replays_in_order_even_twice():
    """A value through ``replayed`` is computed in the forward pass only; a second backward pass
    (``retain_graph``) replays it again; a recomputation that asks for more values is refused."""
    from torch.utils.checkpoint import checkpoint

    from lightning_troll.trust_region.replay import Replay, replayed

    computed = []

    def fn(x):
        scale = replayed(lambda: computed.append(1) or float(x.detach().sum()))
        return (x * scale).square()  # saves x * scale: the backward pass recomputes it

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    replay = Replay()
    y = checkpoint(fn, x, use_reentrant=False, context_fn=replay.contexts)
    y.sum().backward(retain_graph=True)
    assert computed == [1] and replay.values == [3.0]
    assert x.grad.tolist() == [18.0, 36.0]  # d(3x)^2/dx = 18x, the scale held constant
    y.sum().backward()
    assert computed == [1] and x.grad.tolist() == [36.0, 72.0]
    assert replayed(lambda: 7) == 7  # outside a chunk it just computes

    calls = iter([1, 2])

    def growing(x):  # asks for a second value only when recomputed
        return (x * sum(replayed(lambda: 1.0) for _ in range(next(calls)))).square()

    z = checkpoint(growing, x, use_reentrant=False, context_fn=Replay().contexts)
    with pytest.raises(
        RuntimeError, match=r"asked for more values than its forward pass computed \(1\)"
    ):
        z.sum().backward()


def test_troll_refuses_bad_token_values_before_projecting_a_chunk(monkeypatch):
    """Out-of-range ids, and (support official) old rows without their sampled token, are refused
    with the projection's messages before any chunk's logits are made."""
    policy, inputs, targets, objective = _troll_case("official")
    hidden = response_hidden(policy, *inputs, T)
    head = linear_head(policy)
    made = []
    monkeypatch.setattr(objective, "_hidden_terms", lambda *a, **k: made.append(1))
    bad = targets.tokens.clone()
    bad[0, 0] = V + 3
    with pytest.raises(
        ValueError,
        match=rf"tokens must hold token ids in \[0, {V}\); got values in \[\d+, {V + 3}\]",
    ):
        objective.forward_hidden(
            hidden, head, TEMPERATURE, replace(targets, tokens=bad), chunk_size=4
        )
    # the old policy's top token only: most rows lack their sampled token
    rows = response_logits(llama(seed=1), *inputs, T, TEMPERATURE)[targets.mask]
    lacking = replace(targets, old=sparsify(rows, max_tokens=1, mass_delta=0.0))
    with pytest.raises(
        ValueError,
        match=r"support='official' projects on the old policy's kept tokens, which must hold the sampled token",
    ):
        objective.forward_hidden(hidden, head, TEMPERATURE, lacking, chunk_size=4)
    assert made == []
    # the layer on its own refuses the same rows
    with pytest.raises(ValueError, match=r"must hold the sampled token"):
        objective.projection(rows, lacking.old, targets.tokens[targets.mask])


def test_forward_hidden_checks_its_options():
    objective = build_objective("clip")
    hidden, mask = torch.zeros(2, 3, H), torch.ones(2, 3, dtype=torch.bool)
    tokens, zeros = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    inputs = LossInputs(
        tokens=tokens, mask=mask, advantages=zeros[:, 0], old_logprobs=zeros, old=None
    )
    head = nn.Linear(H, V)
    with pytest.raises(ValueError, match=r"hidden must be \(B, T, H\); got shape \(6, 16\)"):
        objective.forward_hidden(hidden.flatten(0, 1), head, 1.0, inputs)
    with pytest.raises(ValueError, match=r"temperature must be > 0; got 0"):
        objective.forward_hidden(hidden, head, 0, inputs)
    with pytest.raises(ValueError, match=r"chunk_size must be null .* got 0"):
        objective.forward_hidden(hidden, head, 1.0, inputs, chunk_size=0)
    old = sparse_old(torch.randn(5, V), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"old must have one row per response token, N = 6; got 5"):
        objective.forward_hidden(hidden, head, 1.0, replace(inputs, old=old))


def soft_capped_model() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=H // 2,
        max_position_embeddings=64,
        final_logit_softcapping=0.05,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).double().eval()


def test_soft_capped_logits_fall_back_to_the_full_logits(monkeypatch):
    monkeypatch.setattr(forward_module, "_warned", set())
    model = soft_capped_model()
    ids, attention, response = batch()
    message = (
        r"Gemma2ForCausalLM: logits are not a plain output layer .*final_logit_softcapping=0.05"
    )
    with pytest.warns(UserWarning, match=message):
        assert linear_head(model) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per model class
        assert linear_head(model) is None
        logp, old = behaviour_outputs(model, ids, attention, response, 1.0, sparse_old, 4)

    # The output layer applied to the hidden states gives other logits for this model ...
    with torch.no_grad():
        capped = response_logits(model, ids, attention, T, 1.0)[response]  # (N, V)
        plain = model.get_output_embeddings()(response_hidden(model, ids, attention, T)[response])
    assert (plain - capped).abs().max() > 0.1
    # ... so the chunked call used the full logits and equals the unchunked one.
    full_logp, full = behaviour_outputs(model, ids, attention, response, 1.0, sparse_old)
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)
    assert torch.equal(old.indices, full.indices)
    torch.testing.assert_close(old.logprobs, full.logprobs, rtol=0, atol=1e-12)


def test_a_plain_llama_head_is_used():
    model = llama(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert linear_head(model) is model.lm_head


@pytest.mark.parametrize("bad", [0, -1, True])
def test_module_refuses_a_bad_logits_chunk_size(bad, tiny_model_dir):
    message = f"model.optimization.logits_chunk_size must be null (no chunks) or an integer >= 1; got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        TrollModule(
            model=str(tiny_model_dir), optimization=OptimizationConfig(logits_chunk_size=bad)
        )


@pytest.mark.slow
def test_training_in_chunks_equals_training_on_full_logits(tmp_path, tiny_model_dir):
    from tests.test_training import fit, make_module, sgd

    runs = []
    for chunk_size in (None, 3):
        module = make_module(
            tiny_model_dir,
            optimizer=sgd(0.5),
            optimization=OptimizationConfig(
                epochs_per_rollout=2, gradient_clip_norm=None, logits_chunk_size=chunk_size
            ),
        )
        _, _, recorder = fit(
            tmp_path / str(chunk_size), tiny_model_dir, max_steps=2, module=module,
            limit_val_batches=0,
        )  # fmt: skip
        weights = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
        runs.append((weights, recorder))
    (full_weights, full), (weights, chunked) = runs
    assert chunked.rollouts[0].response_mask.sum() > 3  # more than one chunk
    for a, b in zip(full.rollouts, chunked.rollouts, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        torch.testing.assert_close(b.old_logprobs, a.old_logprobs, rtol=0, atol=1e-6)
        assert torch.equal(b.old.indices, a.old.indices)
    stats = [s for steps in full.stats for s in steps]
    c_stats = [s for steps in chunked.stats for s in steps]
    assert max(float(s.projection.kl_before.max()) for s in stats) > 0  # the policy moved
    for s, c in zip(stats, c_stats, strict=True):
        torch.testing.assert_close(c.loss, s.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weights, full_weights, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_chunks_under_fsdp2_equal_the_unsharded_full_logits(tmp_path):
    """FSDP2 (``fully_shard`` on each decoder layer and the root, one CPU process over gloo):
    the root's forward gathers the output layer, whose chunks then give the loss and gradients
    of the unsharded model's full logits; the chunked behaviour outputs match as well."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    policy, behaviour = llama(seed=0).train(), llama(seed=1)
    ids, attention, response = batch()
    old_logprobs, old = behaviour_outputs(behaviour, ids, attention, response, 1.0, sparse_old)
    advantages = torch.randn(len(PROMPT_LENGTHS), generator=torch.Generator().manual_seed(1))
    targets = LossInputs(
        tokens=ids[:, S:],
        mask=response,
        advantages=advantages.double(),
        old_logprobs=old_logprobs,
        old=old,
    )
    objective = build_objective("troll", eps=0.0042, max_tokens=5, mass_delta=1e-3)
    loss, _ = objective(response_logits(policy, ids, attention, T, 1.0), targets)
    loss.backward()
    full_logp, full = behaviour_outputs(policy, ids, attention, response, 1.0, sparse_old)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        sharded = copy.deepcopy(policy)
        sharded.zero_grad(set_to_none=True)
        mesh = init_device_mesh("cpu", (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        logp, chunked = behaviour_outputs(sharded, ids, attention, response, 1.0, sparse_old, 4)
        hidden = response_hidden(sharded, ids, attention, T)
        c_loss, _ = objective.forward_hidden(
            hidden, linear_head(sharded), 1.0, targets, chunk_size=4
        )
        c_loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-6)
    assert torch.equal(chunked.indices, full.indices)
    torch.testing.assert_close(c_loss.detach(), loss.detach(), rtol=1e-10, atol=0)
    for name, p in policy.named_parameters():
        assert p.grad.abs().max() > 0
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12)
