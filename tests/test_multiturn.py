"""Multi-turn rollouts (``model.episodes``): the collector runs episodes instead of single
completions, and the trust region acts on the model's own tokens only.

TinyMath has no chat template, so its episodes are plain text: ``tests.tool_helpers:PlainTurns``
starts from the row's prompt and replies ``"+1="`` after each turn but the last.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.objectives import CorrectionsConfig
from lightning_troll.rollouts.episodes import Episode
from lightning_troll.rollouts.forward import response_logits
from lightning_troll.rollouts.multiturn import episode_figures
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.rollouts.samples import filled_rewards
from lightning_troll.tasks.data.datamodule import PromptDataModule
from lightning_troll.tasks.environments import Step
from lightning_troll.tasks.environments.calls import TOOL_ERROR_KINDS
from lightning_troll.tasks.environments.options import EpisodesConfig
from lightning_troll.tasks.rewards.registry import RewardOutput
from lightning_troll.training.module import (
    DynamicSamplingConfig,
    EngineConfig,
    OptimizationConfig,
    TrollModule,
)
from tests.test_training import make_module as training_module

ONE_TURN = EpisodesConfig(environment="tests.tool_helpers:PlainTurns", max_turns=4)
THREE_TURNS = EpisodesConfig(environment="tests.tool_helpers:ThreePlainTurns", max_turns=4)


def make_module(model_dir: Path, **kwargs) -> TrollModule:
    """test_training's module, with room for three turns, a teacher-forced behaviour pass and
    full logits (so that a test can take their gradient)."""
    options = {
        "sampling": SamplingConfig(max_new_tokens=12),
        "engine": EngineConfig(behaviour_logprobs="forward"),
        "optimization": OptimizationConfig(logits_chunk_size=None),
    }
    return training_module(model_dir, **{**options, **kwargs})


def a_batch(model_dir: Path):
    data = PromptDataModule(
        source="tinymath", tokenizer=str(model_dir), batch_size=2, num_train=8, num_val=0
    )
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def collect(module: TrollModule, batch, seed: int = 0):
    torch.manual_seed(seed)
    return module.collector.collect(batch)


def test_an_episode_of_one_turn_is_the_single_turn_rollout(tiny_model_dir):
    """Bit for bit: the same tokens, masks, behaviour log-probs, sparse old rows, rewards and
    advantages as a rollout without episodes, from the same seed, when both take the behaviour
    log-probs from a teacher-forced pass (make_module's ``behaviour_logprobs: forward``; under
    ``auto`` in float32 the single-turn rollout records them while sampling instead, and the
    two agree up to float rounding)."""
    batch = a_batch(tiny_model_dir)
    plain, _ = collect(make_module(tiny_model_dir), batch)
    episodic, report = collect(make_module(tiny_model_dir, episodes=ONE_TURN), batch)
    for field in dataclasses.fields(Rollout):
        a, b = getattr(plain, field.name), getattr(episodic, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        elif field.name == "old":  # TROLL's sparse rows of the behaviour policy
            for part in ("indices", "logprobs", "tail_logmass"):
                assert torch.equal(getattr(a, part), getattr(b, part)), part
        else:
            assert a == b, field.name
    assert report.engine["episodes/turns_mean"] == 1.0
    assert report.engine["episodes/env_tokens_mean"] == 0.0


def test_environment_tokens_are_attended_but_outside_the_loss(tiny_model_dir):
    """Three turns: the replies are in the sequence (attended), never in the response mask; the
    old distributions are cached for the model's tokens only; the behaviour log-probs of the
    model's tokens equal a teacher-forced pass over the whole episode."""
    module = make_module(tiny_model_dir, episodes=THREE_TURNS)
    rollout, report = collect(module, a_batch(tiny_model_dir))
    length = rollout.response_mask.shape[1]
    responses = rollout.input_ids[:, -length:]
    attended = rollout.attention_mask[:, -length:].bool()
    env = attended & ~rollout.response_mask
    assert env.any() and (rollout.response_mask <= attended).all()
    episodes = report.kept.episodes
    for i, episode in enumerate(episodes):
        n = len(episode.token_ids)
        assert responses[i, :n].tolist() == episode.token_ids
        assert rollout.response_mask[i, :n].long().tolist() == episode.mask
        replies = [t for t, m in zip(episode.token_ids, episode.mask, strict=True) if not m]
        tokenizer = module.tokenizer
        assert tokenizer.decode(replies) == "+1=" * (episode.turns - 1)
    assert rollout.old.num_rows == int(rollout.response_mask.sum())
    with torch.no_grad():
        logits = response_logits(
            module.policy, rollout.input_ids, rollout.attention_mask, length, 1.0
        )  # (B, T, V)
    forced = logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    mask = rollout.response_mask
    torch.testing.assert_close(rollout.old_logprobs[mask], forced[mask], rtol=0, atol=1e-5)
    assert (rollout.old_logprobs[~mask] == 0).all()
    ended = [e.end for e in episodes]
    assert report.engine["episodes/frac_end_done"] == ended.count("done") / len(ended)
    assert report.engine["episodes/turns_mean"] == sum(e.turns for e in episodes) / len(ended)


@pytest.mark.parametrize("objective", ["troll", "clip"])
def test_environment_tokens_carry_exactly_zero_gradient(tiny_model_dir, objective):
    """The loss's gradient with respect to the logits is exactly zero at every environment token
    (and not at the model's), and the objective's statistics count the model's tokens only."""
    module = make_module(tiny_model_dir, episodes=THREE_TURNS, objective=objective)
    rollout, _ = collect(module, a_batch(tiny_model_dir))
    # move the policy so the second pass is off-policy and the constraint acts
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    length = rollout.response_mask.shape[1]
    logits = response_logits(
        module.policy, rollout.input_ids, rollout.attention_mask, length, rollout.temperature
    )  # (B, T, V)
    logits.retain_grad()
    loss, stats = module.objective(logits, rollout.loss_inputs())
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # (B, T)
    env = rollout.attention_mask[:, -length:].bool() & ~rollout.response_mask
    assert env.any()
    assert (grad[env] == 0).all() and (grad[~rollout.attention_mask[:, -length:].bool()] == 0).all()
    assert (grad[rollout.response_mask] > 0).any()
    assert int(stats.num_tokens) == int(rollout.response_mask.sum())


def test_episodes_train_from_the_command_line(tmp_path, tiny_model_dir, monkeypatch):
    """``model.episodes`` from the command line: two optimiser steps on three-turn episodes,
    whose figures are logged."""
    from tests.test_cli import ROOT, one_step, run

    args = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"), *one_step(tiny_model_dir)]
    args += ["--model.episodes.environment", "tests.tool_helpers:ThreePlainTurns"]
    args += ["--model.sampling.max_new_tokens", "16", "--trainer.max_steps", "2"]
    monkeypatch.syspath_prepend(str(ROOT))
    cli = run(args, tmp_path, monkeypatch)
    assert cli.trainer.global_step == 2
    assert cli.model.episodes.config.max_turns == 4
    turns = float(cli.trainer.logged_metrics["episodes/turns_mean"])  # the last rollout's
    assert 1 <= turns <= 3
    assert 0 <= float(cli.trainer.logged_metrics["episodes/frac_end_done"]) <= 1
    assert "val/accuracy" in cli.trainer.logged_metrics  # validated on episodes too


def test_prompt_formatting_that_episodes_would_not_use_is_refused(tmp_path, monkeypatch, capsys):
    """``data.system_prompt`` and ``data.template`` format single completions' prompts; an
    episode's environment writes its own conversation from the row, so with ``model.episodes``
    they are refused by the command before the model loads (a model that does not exist is
    never reached), and by a module fitted in Python on a DataModule built apart."""
    from lightning_troll.training.preflight import check_episode_prompts, check_fit_data
    from tests.conftest import refused_here
    from tests.test_cli import ROOT

    episodes = EpisodesConfig(environment="tests.tool_helpers:ThreePlainTurns")
    check_episode_prompts(None, "Q: {prompt}", "Be brief.")  # single completions use both
    check_episode_prompts(episodes, "{prompt}", None)
    message = (
        "data.system_prompt='Be brief.' does not apply to model.episodes: an episode's "
        "environment writes its conversation from the data row (the built-in one from the row's "
        "prompt, unformatted), so the model would never read it; set data.system_prompt to None, "
        "and put a system message or the wording in the rows' messages, or in the environment's "
        "reset"
    )
    base = ["fit", "--config", str(ROOT / "configs" / "tinymath.yaml"),
            "--model.model", str(tmp_path / "no_model"),
            "--model.episodes.environment", "tests.tool_helpers:ThreePlainTurns"]  # fmt: skip
    monkeypatch.syspath_prepend(str(ROOT))
    stderr = refused_here(
        [*base, "--data.system_prompt", "Be brief."], tmp_path, monkeypatch, capsys
    )
    assert message in stderr and "no_model" not in stderr
    stderr = refused_here([*base, "--data.template", "Q: {prompt}"], tmp_path, monkeypatch, capsys)
    assert "data.template='Q: {prompt}' does not apply to model.episodes" in stderr
    assert "set data.template to '{prompt}'" in stderr

    class Data:
        source, batch_size, template, system_prompt = "tinymath", 2, "{prompt}", "Be brief."

    check_fit_data(None, None, 4, Data())  # no episodes: nothing to refuse
    with pytest.raises(ValueError, match=r"^data.system_prompt='Be brief.' does not apply"):
        check_fit_data(None, None, 4, Data(), episodes)


def test_episodes_options_are_checked_before_the_model_loads():
    with pytest.raises(ValueError, match=r"model.episodes.max_turns must be >= 1; got 0"):
        EpisodesConfig(environment="x:y", max_turns=0)
    with pytest.raises(ValueError, match=r"name an environment .* or list tools"):
        EpisodesConfig()
    tools = ["tests.tool_helpers:multiply"]
    for option, value, allowed in [
        ("tool_failures", "ignore", "one of raise, warn"),
        ("tool_failure_limit", 0, r"a share in \(0, 1\]"),
        ("tool_failure_limit", 1.5, r"a share in \(0, 1\]"),
        ("tool_reply_chars", 0, "an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=rf"model.episodes.{option} must be {allowed}; got"):
            EpisodesConfig(tools=tools, **{option: value})


def test_validation_of_one_turn_episodes_is_the_single_turn_validation(tiny_model_dir):
    """Validation plays episodes with the policy (greedy, and k sampled per prompt): with one
    turn each, every figure of the single-turn validation is the same, and the greedy episodes'
    own figures say one turn each, ended by the environment or by the budget."""
    from lightning_troll.training.validation import validation_metrics

    batch = dataclasses.replace(a_batch(tiny_model_dir), samples=3)
    plain = validation_metrics(make_module(tiny_model_dir), batch, 0)
    episodic = validation_metrics(make_module(tiny_model_dir, episodes=ONE_TURN), batch, 0)
    assert set(plain) == {"val/accuracy", "val/reward", "val/pass@3", "val/mean@3"}
    for name, (value, count) in plain.items():
        assert torch.equal(value, episodic[name][0]) and count == episodic[name][1], name
    own = {name: (float(v), n) for name, (v, n) in episodic.items() if name not in plain}
    assert own["val/episodes/turns_mean"] == (1.0, 2)  # ended by the environment or the budget
    done, cut = own["val/episodes/frac_end_done"][0], own["val/episodes/frac_end_max_tokens"][0]
    assert done + cut == 1.0 and own["val/episodes/frac_end_max_turns"] == (0.0, 2)
    assert float(plain["val/reward"][0]) > 0  # length rewards: the answers were scored


def test_validation_reports_what_the_greedy_episodes_did_over_the_counted_prompts(
    tiny_model_dir, monkeypatch
):
    """``val/episodes/...`` are the rollout's episode figures of the greedy episodes, each
    weighed by the prompts counted; a copy that only pads a shared validation set (``counted``
    false) is played but left out. Scripted turns: the first row's episode plays its three
    turns (two tokens each, the second an end of text), the second's first turn runs past the
    budget of 12 tokens."""
    from lightning_troll.training import validation

    module = make_module(tiny_model_dir, episodes=THREE_TURNS)
    batch = a_batch(tiny_model_dir)
    first, eos = batch.rows[0]["prompt"], module.policies.eos_id
    decode = module.policies.tokenizer.decode

    def scripted(*args, **kwargs):
        def turns(prompts, max_new_tokens, stops):
            return [[5, eos] if first in decode(p) else [5] * 20 for p in prompts]

        return turns

    monkeypatch.setattr(validation, "sampled_turns", scripted)
    expected = {
        (True, True): {"turns_mean": 2.0, "frac_end_done": 0.5, "frac_end_max_tokens": 0.5},
        (True, False): {"turns_mean": 3.0, "frac_end_done": 1.0, "frac_end_max_tokens": 0.0},
    }
    for counted, figures in expected.items():
        batch = dataclasses.replace(batch, counted=list(counted))
        own = {
            name: (float(value), count)
            for name, (value, count) in validation.validation_metrics(module, batch, 0).items()
            if name.startswith("val/episodes/")
        }
        assert set(own) == {f"val/{name}" for name in episode_figures([])}
        for name, value in figures.items():
            assert own[f"val/episodes/{name}"] == (value, sum(counted)), name
        assert own["val/episodes/frac_end_max_turns"] == (0.0, sum(counted))
        assert own["val/episodes/env_tokens_mean"][0] > 0  # the first row's replies


def test_validation_of_several_turns_scores_the_last_turn(tiny_model_dir):
    """Three turns: the validated answer is the episode's last turn, not the whole response."""
    from lightning_troll.training import validation

    module = make_module(tiny_model_dir, episodes=THREE_TURNS)
    batch = a_batch(tiny_model_dir)
    scored, _ = validation._answers(module, batch, 1, do_sample=False)
    generate = validation.sampled_turns(module.policy, module.sampling, 0, do_sample=False)
    rows = list(batch.rows)
    sampled = module.episodes.sample(generate, rows, 0, module.device)
    last = [e.turn_texts[-1] for e in sampled.episodes]
    assert all(e.turns == 3 or e.end != "done" for e in sampled.episodes)
    lengths = [float(len(module.policies.decode(*pair)[0])) for pair in _last_turns(sampled)]
    assert scored.total.tolist() == lengths
    assert len(last) == len(rows)


def _last_turns(sampled):
    from lightning_troll.rollouts.multiturn import last_turn

    mask = sampled.response_mask
    responses = sampled.input_ids[:, -mask.shape[1] :]
    last = last_turn(mask, sampled.episodes)
    return [(responses[i : i + 1], last[i : i + 1]) for i in range(len(responses))]


SCORED = EpisodesConfig(environment="tests.tool_helpers:ScoredPlainTurns", max_turns=4)


def test_the_environment_alone_scores_episodes_with_empty_rewards(tiny_model_dir):
    """``model.rewards: {}`` with episodes: an episode's reward is the sum of its environment's
    turn rewards (here each turn's length), in training and in validation, where an episode
    with a positive reward is correct."""
    from lightning_troll.training import validation

    module = make_module(tiny_model_dir, rewards={}, episodes=SCORED)
    assert module.scorer.functions == {}
    batch = a_batch(tiny_model_dir)
    rollout, report = collect(module, batch)
    expected = [_env_reward(e) for e in report.kept.episodes]
    assert rollout.rewards.tolist() == expected and report.kept.scored.per_function == {}
    assert len(set(expected)) > 1  # turns of several lengths: the rewards vary
    greedy, _ = validation._answers(module, batch, 1, do_sample=False)
    generate = validation.sampled_turns(module.policy, module.sampling, 0, do_sample=False)
    played = module.episodes.sample(generate, list(batch.rows), 0, module.device)
    assert greedy.total.tolist() == [_env_reward(e) for e in played.episodes]
    figures = validation.validation_metrics(module, batch, 0)
    assert figures["val/reward"] == (greedy.total.mean(), len(batch.prompts))
    assert figures["val/accuracy"] == ((greedy.total > 0).float().mean(), len(batch.prompts))


def _env_reward(episode) -> float:
    """The sum of an episode's turn rewards (None: a turn the environment did not answer)."""
    return sum(r for r in episode.turn_rewards if r is not None)


def test_empty_rewards_without_episodes_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.rewards must name at least one reward function"):
        make_module(tiny_model_dir, rewards={})


def test_tools_and_the_environment_are_refused_before_the_model_loads(tmp_path):
    """A tool or an environment named wrong is refused before anything loads: the model folder
    here is empty, and loading it would fail with another error."""
    empty = tmp_path / "no_model_here"
    empty.mkdir()
    wrong = [
        (EpisodesConfig(tools=["no_such_module:multiply"]), "model.episodes.tools"),
        (EpisodesConfig(environment="tests.tool_helpers:NoSuchEnvironment"),
         "model.episodes.environment"),
    ]  # fmt: skip
    for episodes, option in wrong:
        with pytest.raises(ValueError, match=option):
            TrollModule(model=str(empty), rewards={}, episodes=episodes)


def test_tools_without_a_chat_template_are_refused_before_the_weights_load(
    tiny_model_dir, monkeypatch
):
    """TinyMath's tokenizer has no chat template to show tools: the tokenizer loads first, and
    the refusal comes before the weights do."""
    from lightning_troll.training import policies

    loaded = []
    monkeypatch.setattr(policies, "load_policy", lambda *a, **k: loaded.append(a))
    with pytest.raises(ValueError, match=r"^model.episodes.tools: the model's tokenizer has no "
                                         r"chat template to show the tools"):  # fmt: skip
        TrollModule(
            model=str(tiny_model_dir),
            rewards={"last_number": 1.0},
            episodes=EpisodesConfig(tools=["tests.tool_helpers:multiply"]),
        )
    assert loaded == []


def test_every_kind_of_tool_error_has_its_figure_at_zero_where_none_occurred():
    """Figures are reduced over the processes name by name, so every process must log the same
    names whatever its episodes met: a rollout without tool errors gives every kind's figure at
    0, and one with errors gives each kind its count per episode (2 timeouts and 1 unknown tool
    over 2 episodes: 1.0 and 0.5)."""
    quiet = Episode([1], [5, 6], [1, 1], [0.0, 0.0], ["a"], [None], "done")
    kinds = (
        "malformed",
        "unknown",
        "bad_arguments",
        "raised",
        "timeout",
        "unrenderable",
        "crashed",
    )
    assert kinds == TOOL_ERROR_KINDS
    names = [f"episodes/tool_errors_{kind}" for kind in kinds]
    figures = episode_figures([quiet, quiet])
    assert {name: figures[name] for name in names} == dict.fromkeys(names, 0.0)
    noisy = dataclasses.replace(quiet, tool_calls=3, tool_errors={"timeout": 2, "unknown": 1})
    figures = episode_figures([quiet, noisy])
    expected = {**dict.fromkeys(names, 0.0), names[4]: 1.0, names[1]: 0.5}
    assert {name: figures[name] for name in names} == expected
    assert set(episode_figures([quiet])) == set(episode_figures([noisy]))


def test_a_step_refuses_a_kind_of_tool_error_that_has_no_figure():
    with pytest.raises(ValueError) as error:
        Step(tool_errors={"mine": 1, "timeout": 1})
    assert str(error.value) == (
        "Step.tool_errors: 'mine' is not a kind of tool error; the kinds are malformed, unknown, "
        "bad_arguments, raised, timeout, unrenderable, crashed"
    )


def test_a_dropped_reward_is_filled_from_the_whole_rewards_of_its_group():
    """A group of three: the reward functions give 1, (dropped), 0.5 and the environment 0.25,
    0.75, -0.5. The valid episodes' whole rewards are 1.25 and 0.0, so the dropped one takes
    their mean, 0.625, and the group's mean stays 0.625: no one's advantage shifts. Filling from
    the functions' rewards alone (0.75), then adding its own 0.75, would give 1.5."""
    scored = RewardOutput(torch.tensor([1.0, 0.0, 0.5]), {}, torch.tensor([True, False, True]))
    rewards = filled_rewards(scored, 3, torch.tensor([0.25, 0.75, -0.5]))
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.25, 0.625, 0.0]


def test_a_dropped_episode_shifts_no_advantage(tiny_model_dir):
    """Episodes whose environment rewards each turn's length, in groups of 4; the reward
    functions give 1, 0 (dropped), 0.5 and 0.25. The dropped episode's reward is the mean of
    the three others' whole rewards, so its group's mean is theirs."""
    module = make_module(tiny_model_dir, episodes=SCORED)
    totals = torch.tensor([1.0, 0.0, 0.5, 0.25] * 2)
    valid = torch.tensor([True, False, True, True] * 2)
    scorer = lambda *args, **kwargs: RewardOutput(totals, {"f": totals}, valid)  # noqa: E731
    torch.manual_seed(0)
    _, report = dataclasses.replace(module.collector, scorer=scorer).collect(
        a_batch(tiny_model_dir)
    )
    env = torch.tensor([_env_reward(e) for e in report.kept.episodes])
    assert len(set(env.tolist())) > 1  # turns of several lengths
    whole = (totals + env).view(2, 4)[:, [0, 2, 3]]  # (P, 3) the valid episodes'
    rewards = report.kept.rewards.view(2, 4)
    torch.testing.assert_close(rewards[:, [0, 2, 3]], whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(rewards[:, 1], whole.mean(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(rewards.mean(-1), whole.mean(-1), rtol=0, atol=1e-5)


def test_an_episode_counts_its_whole_response_against_the_budget(tiny_model_dir):
    """``completion_tokens`` (what the ``overlong`` penalty reads) is an episode's response
    length, the model's and the environment's tokens, which share the budget
    ``max_new_tokens``: in training and in validation alike. An episode the budget cut off is
    truncated, and with ``mask_truncated`` leaves the loss."""
    from lightning_troll.training import validation

    module = make_module(
        tiny_model_dir,
        episodes=THREE_TURNS,
        rewards={"tests.reward_helpers:token_count": 1.0},
        corrections=CorrectionsConfig(mask_truncated=True),
    )
    batch = a_batch(tiny_model_dir)
    rollout, report = collect(module, batch)
    episodes = report.kept.episodes
    assert report.kept.scored.total.tolist() == [float(len(e.token_ids)) for e in episodes]
    assert any(sum(e.mask) < len(e.token_ids) for e in episodes)  # the replies count too
    cut = [e.end in ("max_tokens", "no_room") for e in episodes]
    assert report.kept.truncated.tolist() == cut and any(cut)
    assert not rollout.response_mask[torch.tensor(cut)].any()
    greedy, _ = validation._answers(module, batch, 1, do_sample=False)
    generate = validation.sampled_turns(module.policy, module.sampling, 0, do_sample=False)
    played = module.episodes.sample(generate, list(batch.rows), 0, module.device)
    assert greedy.total.tolist() == [float(len(e.token_ids)) for e in played.episodes]


def test_sampling_behaviour_logprobs_with_episodes_warn_once_at_the_start_of_a_fit():
    """Episodes take their behaviour log-probs from a teacher-forced pass whatever
    ``model.engine.behaviour_logprobs`` says: ``sampling`` warns once, as the fit starts; ``auto`` and
    ``forward`` with episodes, and ``sampling`` without, do not."""
    import warnings
    from types import SimpleNamespace

    from lightning_troll.callbacks import RolloutGeneration

    def setup(episodes, behaviour_logprobs):
        module = SimpleNamespace(
            episodes=episodes,
            engine_config=EngineConfig(behaviour_logprobs=behaviour_logprobs),
            dynamic_sampling=DynamicSamplingConfig(),
        )
        RolloutGeneration().setup(None, module, "fit")

    with pytest.warns(UserWarning) as record:
        setup(object(), "sampling")
    assert [str(w.message) for w in record] == [
        "model.engine.behaviour_logprobs='sampling' does not apply to model.episodes: an episode's "
        "behaviour log-probs come from one teacher-forced pass of the snapshot over the whole "
        "episode once it is played, as with 'forward'; set model.engine.behaviour_logprobs to 'forward' "
        "or 'auto'"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for episodes, option in [(object(), "auto"), (object(), "forward"), (None, "sampling")]:
            setup(episodes, option)
