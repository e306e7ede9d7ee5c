"""The projection's supports (union, official, dense) against each other and a float64 reference,
the option in YAML and the module, and seeds that vary the data."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lightning_troll.objectives import LossInputs, TrollObjective, TrustRegionConfig
from lightning_troll.objectives.chunking import HiddenRows
from lightning_troll.trust_region.projection import SUPPORTS, TrustRegionProjection, sparsify
from tests.reference import dense_projection

EPS = 0.05


def problem(n=6, vocab=40, seed=0, spread=3.0, drift=1.0):
    gen = torch.Generator().manual_seed(seed)
    new = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * spread
    old = new + torch.randn(n, vocab, generator=gen, dtype=torch.float64) * drift
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return new, old, tokens


def loss_and_grad(layer, new, old, tokens):
    """The TROLL row loss -ratio + KL regression (advantage 1) and its gradient in the logits."""
    x = new.clone().requires_grad_()
    result = layer(x, old, tokens)
    loss = (-(result.logprob - result.old_logprob).exp() + result.regression_kl).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return result, grad


def test_dense_matches_the_float64_reference_and_the_bound_holds():
    new, old, tokens = problem()
    result, _ = loss_and_grad(TrustRegionProjection(EPS, support="dense"), new, old, tokens)
    expected = dense_projection(new, old, EPS).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(result.logprob, expected, rtol=0, atol=1e-8)
    assert bool((result.eta > 0).any()), "some rows violate the bound"
    assert bool((result.kl_after <= EPS * (1 + 1e-8)).all())
    torch.testing.assert_close(result.coverage, torch.ones(6, dtype=torch.float64))
    assert result.support_size.tolist() == [40.0] * 6


@pytest.mark.parametrize("support", ["dense", "official"])
def test_projected_logprob_gradient_is_exact(support):
    """gradcheck of the projected token log-prob (through eta*); the regression KL holds pi_proj
    fixed (stop-gradient), so finite differences would not match it by design."""
    new, old, tokens = problem(n=3, vocab=9)
    layer = TrustRegionProjection(EPS, max_tokens=4, mass_delta=0.0, support=support)
    old_rows = old if support == "dense" else sparsify(old, 4, 0.0, keep=tokens)
    assert bool((layer(new, old_rows, tokens).eta > 0).any()), "some rows must be projected"
    assert torch.autograd.gradcheck(
        lambda x: layer(x, old_rows, tokens).logprob,
        new.clone().requires_grad_(),
        atol=1e-7,
        rtol=1e-5,
    )


@pytest.mark.parametrize("support", ["union", "official"])
def test_sparse_supports_equal_dense_when_nothing_is_dropped(support):
    """max_tokens = V, mass_delta = 0: every token is kept, so both sparse supports are exact."""
    new, old, tokens = problem()
    dense, dense_grad = loss_and_grad(TrustRegionProjection(EPS, support="dense"), new, old, tokens)
    layer = TrustRegionProjection(EPS, max_tokens=40, mass_delta=0.0, support=support)
    cached = sparsify(old, 40, 0.0, keep=tokens)
    result, grad = loss_and_grad(layer, new, cached, tokens)
    for name in ("logprob", "new_logprob", "old_logprob", "regression_kl", "kl_after", "eta"):
        torch.testing.assert_close(getattr(result, name), getattr(dense, name), rtol=0, atol=1e-9)
    torch.testing.assert_close(grad, dense_grad, rtol=0, atol=1e-9)


def test_official_renormalises_both_distributions_on_the_old_kept_tokens():
    """Old policy over V = 4: (0.6, 0.3, 0.09, 0.01); max_tokens 2 keeps tokens 0 and 1 and the
    sampled token 3 joins them, so S_old = {0, 1, 3} with mass 0.91. The new policy equals the
    old one: the projection is the identity on S_old, the ratio of the renormalised
    distributions is 1, and the reported log-probs carry pi_old(S_old) = 0.91 back in."""
    probs = torch.tensor([[0.6, 0.3, 0.09, 0.01]], dtype=torch.float64)
    logits, token = probs.log(), torch.tensor([3])
    cached = sparsify(logits, max_tokens=2, mass_delta=0.0, keep=token)
    assert sorted(cached.indices[0].tolist()) == [0, 1, 3]
    layer = TrustRegionProjection(EPS, max_tokens=2, mass_delta=0.0, support="official")
    result = layer(logits.clone(), cached, token)
    assert result.eta.item() == 0.0
    assert result.coverage.item() == pytest.approx(0.91, abs=1e-12)
    assert result.support_size.item() == 3
    # renormalised: 0.01 / 0.91 on S_old, times 0.91 back: the old policy's own 0.01
    assert result.logprob.item() == pytest.approx(math.log(0.01), abs=1e-12)
    assert result.old_logprob.item() == pytest.approx(math.log(0.01), abs=1e-12)
    assert result.new_logprob.item() == pytest.approx(math.log(0.01), abs=1e-12)
    assert result.regression_kl.item() == pytest.approx(0.0, abs=1e-12)


def test_official_gives_no_gradient_outside_the_old_support():
    new, old, tokens = problem(vocab=40)
    cached = sparsify(old, max_tokens=4, mass_delta=0.0, keep=tokens)
    layer = TrustRegionProjection(EPS, max_tokens=4, mass_delta=0.0, support="official")
    x = new.clone().requires_grad_()
    result = layer(x, cached, tokens)
    (grad,) = torch.autograd.grad((result.logprob + result.regression_kl).sum(), x)
    inside = torch.zeros_like(grad, dtype=torch.bool).scatter_(
        -1, cached.indices.clamp_min(0), True
    )
    assert grad[~inside].abs().max().item() == 0.0
    assert grad[inside].abs().max().item() > 0
    assert bool((result.kl_after <= EPS * (1 + 1e-8)).all())


def test_sparse_supports_differ_from_dense_when_tokens_are_dropped():
    """A flat old distribution capped at 4 tokens: the supports are approximations and differ."""
    new, old, tokens = problem(spread=1.0, drift=1.5)
    _, dense = loss_and_grad(TrustRegionProjection(EPS, support="dense"), new, old, tokens)
    errors = {}
    for support in ("union", "official"):
        layer = TrustRegionProjection(EPS, max_tokens=4, mass_delta=0.0, support=support)
        _, grad = loss_and_grad(layer, new, sparsify(old, 4, 0.0, keep=tokens), tokens)
        errors[support] = float((grad - dense).norm() / dense.norm())
    assert all(e > 1e-3 for e in errors.values()), errors


def test_dense_takes_hidden_rows_in_the_objective_chunk_by_chunk():
    """TrollObjective with support dense: old logit rows given as hidden states and a head (made
    chunk by chunk) give the loss and gradient of the same rows given whole."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=False).double()
    hidden = torch.randn(2, 5, 8, dtype=torch.float64)
    old_hidden = hidden + 0.3 * torch.randn_like(hidden)
    tokens = torch.randint(0, 30, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    old_logits = head(old_hidden).detach()
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    objective = TrollObjective(support="dense", aggregation="token_mean")
    assert objective.needs_old_logits
    rows = HiddenRows(old_hidden[mask], head)
    inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=rows)
    loss_chunked, stats = objective.forward_hidden(hidden, head, 1.0, inputs, chunk_size=3)
    loss_whole, _ = objective(head(hidden), replace(inputs, old=old_logits[mask]))
    torch.testing.assert_close(loss_chunked, loss_whole, rtol=0, atol=1e-12)
    assert bool((stats.projection.kl_after <= 0.05 * (1 + 1e-8)).all())


def test_unknown_support_is_refused_in_one_line_listing_the_names():
    with pytest.raises(
        ValueError, match=r"support must be one of \['union', 'official', 'dense'\]"
    ):
        TrustRegionProjection(support="exact")
    with pytest.raises(ValueError) as error:
        TrustRegionConfig(support="exact")
    assert str(error.value).startswith("model.trust_region.support must be one of")
    assert "\n" not in str(error.value)
    assert SUPPORTS == ("union", "official", "dense")


def test_official_needs_the_sampled_token():
    with pytest.raises(
        ValueError, match="keep_sampled_token=False needs trust_region.support .union. or .dense."
    ):
        TrustRegionProjection(support="official", keep_token=False)


def test_wrong_old_kind_is_named():
    new, old, tokens = problem()
    with pytest.raises(ValueError, match="old must be the old policy's .N, V. logits"):
        TrustRegionProjection(support="dense")(new, sparsify(old, 4, 0.0, keep=tokens), tokens)
    with pytest.raises(ValueError, match="old must be the old policy's sparse rows"):
        TrustRegionProjection(support="union")(new, old, tokens)


def test_dense_needs_a_separate_snapshot(tiny_model_dir):
    from lightning_troll.models.snapshots import SnapshotConfig
    from lightning_troll.training.module import TrollModule

    with pytest.raises(ValueError, match="support='dense'.*snapshot.mode"):
        TrollModule(
            model=str(tiny_model_dir),
            trust_region=TrustRegionConfig(support="dense"),
            snapshot=SnapshotConfig(mode="shared"),
        )
    module = TrollModule(model=str(tiny_model_dir), trust_region=TrustRegionConfig(support="dense"))
    assert module.objective.projection.support == "dense"


# -- seeds vary the data -------------------------------------------------------------------------


def first_prompts(*args: str) -> tuple[int, int, list[str]]:
    """(data.seed, model.optimization.seed, the first rollout's prompts) of a ``lightning-troll fit`` command
    line, parsed and instantiated as the command does, without training."""
    from lightning_troll.cli.command import TRAINER_DEFAULTS, TrollArgumentParser, TrollCLI
    from lightning_troll.tasks.data.datamodule import PromptDataModule
    from lightning_troll.training.module import TrollModule

    cli = TrollCLI(
        TrollModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        parser_class=TrollArgumentParser,
        auto_configure_optimizers=False,
        run=False,
        args=["--data.num_train", "256", "--data.num_val", "8", "--data.batch_size", "8", *args],
    )
    batch = next(iter(cli.datamodule.train_dataloader()))
    return cli.datamodule.seed, cli.model.minibatch_loop.shuffle.initial_seed(), batch.prompts


def test_runs_with_different_seeds_see_different_prompts():
    seed0, model0, prompts0 = first_prompts("--seed_everything", "0")
    seed1, model1, prompts1 = first_prompts("--seed_everything", "1")
    assert (seed0, model0, seed1, model1) == (0, 0, 1, 1)
    assert prompts0 != prompts1
    assert first_prompts("--seed_everything", "1")[2] == prompts1, "same seed, same prompts"
    # a data.seed given explicitly is kept, whatever the run's seed
    assert first_prompts("--seed_everything", "1", "--data.seed", "0")[::2] == (0, prompts0)


def test_print_config_shows_the_data_seed_used(capsys):
    from lightning_troll.cli.command import run

    with pytest.raises(SystemExit):
        run(["fit", "--seed_everything", "7", "--print_config"])
    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["seed"] == 7 and printed["model"]["optimization"]["seed"] == 7


@pytest.mark.slow
@pytest.mark.parametrize("support", ["official", "dense"])
def test_a_fit_with_each_support_holds_the_bound(tmp_path, tiny_model_dir, support):
    """Two rollouts, two off-policy epochs each: the objective trains on the support asked for,
    and every projected row meets the bound."""
    from lightning_troll.training.module import OptimizationConfig
    from tests.test_training import fit, make_module

    module = make_module(
        tiny_model_dir,
        trust_region=TrustRegionConfig(support=support),
        optimization=OptimizationConfig(epochs_per_rollout=2, minibatch_size=4),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-2),
    )
    _, module, recorder = fit(tmp_path, tiny_model_dir, max_steps=16, module=module)
    assert module.objective.projection.support == support
    steps = [s for rollout in recorder.stats for s in rollout]
    assert len(steps) == 16
    projected = torch.cat([s.projection.eta for s in steps]) > 0
    assert bool(projected.any()), "the step size must make the bound act"
    for stats in steps:
        assert bool((stats.projection.kl_after <= 0.05 * (1 + 1e-4)).all())
    if support == "dense":
        vocab = module.policy.get_output_embeddings().weight.shape[0]
        assert {int(v) for s in steps for v in s.projection.support_size} == {vocab}


# -- on a real model's own logits ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_logits(smollm2_dir):
    """SmolLM2-135M-Instruct's old and new logits at 64 sampled response tokens (T = 1.0): 4 chat
    prompts x 2 completions of 8 tokens, then one AdamW step at 3e-5 on random-sign advantages
    (Adam's first step moves every weight by about its learning rate: three steps at 1e-5)."""
    from lightning_troll.models.loading import load_policy, load_tokenizer

    torch.manual_seed(0)
    tokenizer, policy = load_tokenizer(smollm2_dir), load_policy(smollm2_dir)
    questions = ["What is 7 + 5?", "What is 12 - 4?", "What is 3 * 9?", "What is 11 + 0?"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                      add_generation_prompt=True)
        for q in questions for _ in range(2)
    ]  # fmt: skip
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = policy.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=8, min_new_tokens=8)  # fmt: skip
    mask = torch.cat([batch.attention_mask, torch.ones_like(ids[:, batch.input_ids.shape[1] :])], 1)
    prompt_len = batch.input_ids.shape[1]

    def logits():  # (N, V) at the 64 response tokens
        out = policy(input_ids=ids, attention_mask=mask).logits[:, prompt_len - 1 : -1]
        return out.reshape(-1, out.shape[-1]).float()

    tokens = ids[:, prompt_len:].reshape(-1)
    with torch.no_grad():
        old = logits()
    signs = torch.tensor([1.0, -1.0]).repeat(4).repeat_interleave(8)  # (64,)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-5)
    logp = torch.log_softmax(logits(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    (-(signs * logp).mean()).backward()
    optimizer.step()
    with torch.no_grad():
        new = logits()
    return new.double(), old.double(), tokens, signs.double()


@pytest.mark.slow
def test_dense_and_the_default_against_a_float64_reference_on_smollm2(smollm2_logits):
    """On SmolLM2's own logits (V = 49,152, T = 1.0): the dense support agrees with an independent
    float64 projection by bisection, and the default support's loss gradient lies within 5% of
    the dense one's (docs/supports.md measures the same on a whole rollout)."""
    new, old, tokens, advantages = smollm2_logits
    dense = TrustRegionProjection(EPS, support="dense")
    result = dense(new, old, tokens)
    projected = (result.eta > 0).nonzero().squeeze(-1)
    assert projected.numel() >= 3, "the update must move some tokens past the bound"
    rows = projected[:8]
    expected = dense_projection(new[rows], old[rows], EPS).gather(-1, tokens[rows, None])
    torch.testing.assert_close(result.logprob[rows], expected.squeeze(-1), rtol=0, atol=1e-8)

    default = TrustRegionConfig()
    layer = TrustRegionProjection(
        default.eps, default.max_tokens, default.mass_delta, support=default.support
    )
    cached = sparsify(old, default.max_tokens, default.mass_delta, keep=tokens)
    grads = []
    for lay, old_rows in ((dense, old), (layer, cached)):
        x = new.clone().requires_grad_()
        r = lay(x, old_rows, tokens)
        ratio = (r.logprob - r.old_logprob).exp()
        (-(ratio * advantages) + r.regression_kl).mean().backward()
        grads.append(x.grad)
    error = float((grads[1] - grads[0]).norm() / grads[0].norm())
    assert error < 0.05, f"the default support's gradient is {error:.1%} from the exact one"
