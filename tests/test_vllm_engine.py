"""The vLLM rollout engine on CPU: its log-probs against a teacher-forced pass, weight pushes
(tied heads, LoRA merged), seeded sampling, whole fits with each objective, and DDP and FSDP2
runs of 2 processes with an engine each.

Skipped where vLLM is not installed; ``make test-vllm`` installs it and runs them (``-m vllm``).
The shipped TinyMath policy (a tied 3-layer Llama) serves, and SmolLM2-135M-Instruct for the
real tied head.
"""

from __future__ import annotations

import pytest
import torch

from lightning_troll.engines.base import EngineContext, SampleRequest, build_engine
from lightning_troll.engines.sampling import SamplingConfig, sample
from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.models.weights import full_weights
from lightning_troll.rollouts.forward import behaviour_outputs
from lightning_troll.training.module import EngineConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 5, 14, 6, 16], [1, 7, 13, 8], [1, 9], [1, 4, 12, 4, 16]]


@pytest.fixture(scope="module")
def tinymath():
    tokenizer = load_tokenizer("tinymath")
    policy = load_policy("tinymath")
    engine = build_engine(
        "vllm", EngineContext("tinymath", "float32", tokenizer), {"kv_cache_gib": 0.25}
    )
    yield engine, policy, tokenizer
    engine.close()


def perturbed(policy, scale: float, seed: int):
    """A copy of ``policy`` with seeded Gaussian noise on every weight."""
    import copy

    other = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(scale * noise * parameter.abs().mean())
    return other


def teacher_forced(policy, generation, temperature):
    """The policy's log-probs of the generated tokens, from one whole-sequence pass."""
    logprobs, _ = behaviour_outputs(
        policy,
        generation.input_ids,
        generation.attention_mask,
        generation.response_mask,
        temperature,
        None,
        None,
        False,
    )
    return logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_agree_with_a_teacher_forced_pass(tinymath, temperature):
    engine, policy, tokenizer = tinymath
    weights = perturbed(policy, 0.3, seed=1)
    engine.load_weights(weights)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=8)
    stops = stop_token_ids(tokenizer, policy)
    request = SampleRequest(PROMPTS, 4, sampling, tokenizer.pad_token_id, stops)
    generation = engine.generate(weights, request)
    mask = generation.response_mask
    assert generation.input_ids.shape[0] == 16 and mask.any(-1).all()
    assert generation.logprobs is not None and bool((generation.logprobs[~mask] == 0).all())
    reference = teacher_forced(weights, generation, temperature)
    gap = (generation.logprobs - reference)[mask].abs().max()
    assert float(gap) <= 1e-4, float(gap)
    # the layout the loss expects: the prompt left padded, the response right padded after EOS
    ends = generation.input_ids[:, -mask.shape[1] :].masked_fill(mask, -1)
    assert bool((ends[ends >= 0] == tokenizer.pad_token_id).all())
    assert bool((generation.truncated == ~torch.isin(
        generation.input_ids[:, -mask.shape[1]:], torch.tensor(stops)).any(-1)).all())  # fmt: skip


def test_a_weight_push_changes_the_output_as_an_hf_model_of_those_weights_predicts(tinymath):
    engine, policy, tokenizer = tinymath
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=6)
    stops = list(stop_token_ids(tokenizer, policy))
    pad = tokenizer.pad_token_id
    outputs = []
    for weights in (policy, perturbed(policy, 1.0, seed=2)):
        engine.load_weights(weights)
        got = engine.generate(weights, SampleRequest(PROMPTS, 1, greedy, pad, stops))
        expected = sample(weights, PROMPTS, 1, greedy, pad, stops, do_sample=False)
        assert torch.equal(got.input_ids, expected[0])
        assert torch.equal(got.response_mask, expected[2])
        outputs.append(got.input_ids)
    assert not torch.equal(outputs[0], outputs[1])  # the push did change what it samples


def test_a_seeded_engine_samples_the_same_completions_again(tinymath):
    engine, policy, tokenizer = tinymath
    engine.load_weights(policy)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    stops = stop_token_ids(tokenizer, policy)
    request = SampleRequest(PROMPTS, 4, sampling, tokenizer.pad_token_id, stops)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(engine.generate(policy, request))
        after = torch.rand(())  # the trainer's generator moved by the one seed drawn, no more
        torch.manual_seed(7)
        torch.randint(0, 2**31 - 1, ())
        assert torch.equal(after, torch.rand(()))
    assert torch.equal(runs[0].input_ids, runs[1].input_ids)
    assert len({tuple(row.tolist()) for row in runs[0].input_ids}) > 4  # and it does sample


def test_smollm2s_tied_head_takes_new_weights(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    policy = load_policy(smollm2_dir)
    engine = build_engine("vllm", EngineContext(str(smollm2_dir), "float32", tokenizer))
    try:
        weights = perturbed(policy, 0.02, seed=3)
        with torch.no_grad():  # the tied head (the embedding) moves most
            embedding = weights.model.embed_tokens.weight
            embedding.add_(0.2 * embedding.abs().mean() * torch.randn_like(embedding))
        engine.load_weights(weights)
        prompts = [tokenizer.encode("What is 12 + 30?"), tokenizer.encode("Name a colour.")]
        stops = stop_token_ids(tokenizer, policy)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
        request = SampleRequest(prompts, 2, sampling, tokenizer.pad_token_id, stops)
        generation = engine.generate(weights, request)
        mask = generation.response_mask
        reference = teacher_forced(weights, generation, 1.0)
        gap = (generation.logprobs - reference)[mask].abs().max()
        assert float(gap) <= 1e-4, float(gap)
        before = teacher_forced(policy, generation, 1.0)  # the shipped weights: far off
        assert float((generation.logprobs - before)[mask].abs().max()) > 1e-2
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("objective", "lora"), [("troll", False), ("clip", False), ("troll", True)]
)
def test_a_fit_samples_with_vllm_and_logs_the_engines_mismatch(tmp_path, objective, lora):
    from lightning_troll.models.lora import LoraConfig
    from lightning_troll.training.module import OptimizationConfig
    from tests.test_training import fit, make_module

    module = make_module(
        "tinymath",
        objective=objective,
        engine=EngineConfig("vllm", {"kv_cache_gib": 0.25}),
        optimization=OptimizationConfig(minibatch_size=8),  # two steps: the second off-policy
        lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if lora else None,
        rewards={"tests.reward_helpers:digit_sum": 1.0},  # TinyMath's answers vary in digits
    )
    trainer, module, recorder = fit(tmp_path, "tinymath", max_steps=6, module=module)
    metrics = trainer.callback_metrics
    assert float(metrics["rollout/engine_logprob_diff"]) <= 1e-4
    assert float(metrics["engine/weight_push_s"]) > 0
    assert len(recorder.rollouts) == 3
    # the policy trained: its weights left the shipped ones (so later pushes carried new weights)
    shipped = load_policy("tinymath")
    trained = dict(full_weights(module.policy))  # LoRA: merged
    moved = max(
        float((trained[name] - value).abs().max()) for name, value in shipped.named_parameters()
    )
    assert moved > 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_several_processes_each_sample_with_an_engine_of_their_own(tmp_path, strategy):
    """DDP and FSDP2 on 2 CPU processes (gloo): every process runs its own vLLM engine in the
    trainer's process group, takes the gathered weights after each refresh, and its samples
    agree with the snapshot's log-probs on both processes (the logged mismatch is their mean)."""
    from tests.test_distributed import launch, metrics, weights

    out = launch(tmp_path, "--strategy", strategy, "--engine", "vllm", "--rollouts", "3")
    logged = metrics(out)
    diffs = logged["rollout/engine_logprob_diff"]
    assert len(diffs) == 3  # one a rollout
    assert max(diffs.values()) <= 1e-4
    pushes = logged["engine/weight_push_s"]
    assert len(pushes) == 3 and min(pushes.values()) > 0  # before the first, after each refresh
    # the policy trained, so rollouts 2 and 3 sampled from weights the engine was pushed
    trained, start = weights(out)["policy"], load_policy("tinymath").state_dict()
    assert max(float((trained[n] - v).abs().max()) for n, v in start.items()) > 0


def test_episodes_sample_with_vllm_and_its_logprobs_match_the_snapshot():
    """Three-turn plain-text episodes sampled by vLLM: the environment's replies are in the
    sequence and outside the response mask, and vLLM's log-probs of the model's tokens agree
    with the snapshot's teacher-forced pass (the logged mismatch, over the model's tokens)."""
    from lightning_troll.tasks.environments.options import EpisodesConfig
    from tests.test_multiturn import a_batch
    from tests.test_training import make_module

    episodes = EpisodesConfig(environment="tests.tool_helpers:ThreePlainTurns", max_turns=4)
    module = make_module(
        "tinymath",
        engine=EngineConfig("vllm", {"kv_cache_gib": 0.25}),
        episodes=episodes,
        sampling=SamplingConfig(max_new_tokens=16),
    )
    try:
        torch.manual_seed(0)
        rollout, report = module.collector.collect(a_batch("tinymath"))
    finally:
        module.engine.close()
    length = rollout.response_mask.shape[1]
    attended = rollout.attention_mask[:, -length:].bool()
    assert (attended & ~rollout.response_mask).any()  # the replies
    assert report.engine["episodes/turns_mean"] > 1
    assert report.engine["rollout/engine_logprob_diff"] <= 1e-4
    assert report.kept.engine_logprobs is not None
    assert (report.kept.engine_logprobs[~rollout.response_mask] == 0).all()
    # the 4 episodes of a prompt ask vLLM with identical contexts, turn by turn: they sample apart
    for group in rollout.input_ids.view(2, 4, -1):
        assert len({tuple(row.tolist()) for row in group}) > 1


def test_vllm_in_a_process_of_its_own_samples_with_the_weights_it_was_sent(tinymath):
    """``rollout_engine_options: {process: true}`` with vLLM: the child starts vLLM, samples the
    prompts with the weights sent (its fingerprint says so), and its log-probs are the policy's
    own at the sampled tokens."""
    from lightning_troll.engines.process import fingerprint
    from lightning_troll.training.rollout_parts import engine_in_a_process

    _, policy, tokenizer = tinymath
    context = EngineContext("tinymath", "float32", tokenizer)
    engine = engine_in_a_process("vllm", context, {"process": True, "kv_cache_gib": 0.25})
    sampling = SamplingConfig(max_new_tokens=6)
    other = perturbed(policy, 0.05, seed=1)
    try:
        engine.push({n: w.detach().clone() for n, w in full_weights(other)}, torch.device("cpu"))
        engine.stale = False
        stops = stop_token_ids(tokenizer, policy)
        generation = engine.generate(other, SampleRequest(PROMPTS, 3, sampling, 0, stops))
        assert engine.last_fingerprint == fingerprint(dict(full_weights(other)))
        assert generation.input_ids.shape[0] == len(PROMPTS) * 3
        mask = generation.response_mask
        expected = teacher_forced(other, generation, sampling.temperature)
        assert torch.allclose(generation.logprobs[mask], expected[mask], atol=1e-4)
    finally:
        engine.close()


def test_a_fit_samples_ahead_with_vllm_in_a_process_of_its_own(tmp_path):
    """vLLM in a child process and data one version stale: every rollout after the first is
    sampled by vLLM while the one before it trains, by the weights of the snapshot its trust
    region is built around."""
    from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
    from tests.test_engine_process import SamplerWeights
    from tests.test_training import make_data, make_module, make_trainer

    seen = SamplerWeights()
    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=1), seen]
    trainer = make_trainer(tmp_path, 4, callbacks=callbacks, limit_val_batches=0)
    options = {"process": True, "kv_cache_gib": 0.25}
    module = make_module("tinymath", engine=EngineConfig("vllm", options))
    torch.manual_seed(0)
    try:
        trainer.fit(module, datamodule=make_data("tinymath"))
    finally:
        module.engine.close()
    assert seen.prefetched == [0.0, 1.0, 1.0, 1.0]
    assert seen.sampler == seen.snapshot
    assert len(set(seen.snapshot)) == 3  # version 0 twice, then versions 1 and 2
    assert float(trainer.callback_metrics["rollout/staleness"]) == 1
