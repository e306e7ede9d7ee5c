"""Rollout engines: choosing one, a user's own engine in a fit, when weights are taken, and the
weights an engine takes (LoRA merged, int8 dequantised, tied heads)."""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch

from lightning_troll.engines.base import (
    ENGINES,
    EngineContext,
    Generation,
    RolloutEngine,
    SampleRequest,
    build_engine,
    engine_class,
)
from lightning_troll.engines.hf import HFEngine
from lightning_troll.engines.vllm import vllm_available
from lightning_troll.models.loading import tiny_causal_lm
from lightning_troll.models.quantize import quantize_int8_
from lightning_troll.models.weights import full_weights
from lightning_troll.training.module import AdvantageConfig, EngineConfig
from lightning_troll.training.preflight import check_module_options


class CountingEngine(HFEngine):
    """The HF engine, counting its calls; the engine named by import path in the fits below."""

    name = "counting"
    instances: list[CountingEngine] = []

    def __init__(self, context: EngineContext, tag: str = "") -> None:
        super().__init__(context)
        self.tag = tag
        self.generated = 0
        self.loads: list[int] = []  # the generation count at each weight load
        CountingEngine.instances.append(self)

    def generate(self, *args, **kwargs) -> Generation:
        assert not self.stale, "generate before load_weights"
        self.generated += 1
        return super().generate(*args, **kwargs)

    def load_weights(self, snapshot) -> None:
        self.loads.append(self.generated)
        super().load_weights(snapshot)

    def figures(self) -> dict[str, float]:
        return {"engine/calls": float(self.generated)}


class IgnoresBudgets(HFEngine):
    """An engine that ignores the request's ``budgets``: it samples every prompt up to
    ``sampling.max_new_tokens``."""

    def generate(self, snapshot, request, recorder=None):
        self.asked = request.sampling.max_new_tokens
        return super().generate(snapshot, replace(request, budgets=None), recorder)


@pytest.mark.parametrize("engine_class", [HFEngine, CountingEngine, IgnoresBudgets])
def test_a_turn_is_sampled_up_to_its_episodes_room_where_the_engine_reads_budgets(engine_class):
    """Rooms of 2, 7 and 4 tokens, and a stop the model cannot write: an engine that reads
    ``request.budgets`` (the built-in ones, one that passes the request on) samples each context
    up to its own room; one that ignores them is asked for the largest room for every context,
    and the episode cuts each turn to its room (``tests/test_episodes.py``: a turn sampled up to
    the largest room and cut is the turn sampled up to its own)."""
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.rollouts.episodes import Stops
    from lightning_troll.rollouts.multiturn import EngineTurns

    model = tiny_causal_lm(32).eval()
    engine = engine_class.__new__(engine_class)
    engine.stale, engine.generated = False, 0
    turns = EngineTurns(engine, model, SamplingConfig(max_new_tokens=16), pad_id=0)
    rooms = [2, 7, 4]
    out = turns([[1, 5, 9], [3, 4], [8]], rooms, Stops((32,)))  # 32: outside the vocabulary
    lengths = [len(turn.token_ids) for turn in out]
    if engine_class is IgnoresBudgets:
        assert engine.asked == 7
        assert lengths == [7, 7, 7]
    else:
        assert lengths == rooms


def test_engines_by_name_and_by_import_path():
    assert engine_class("hf") is HFEngine
    assert engine_class("tests.test_engines:CountingEngine") is CountingEngine
    assert engine_class("tests.test_engines.CountingEngine") is CountingEngine
    assert set(ENGINES) == {"hf", "vllm", "vllm_server"}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "vllmm",
            "model.engine.name must be one of ['hf', 'vllm', 'vllm_server'] or an import path",
        ),
        ("tests.test_engines:Missing", "tests.test_engines.Missing is missing"),
        ("tests.test_engines:test_engines_by_name_and_by_import_path", "not a RolloutEngine"),
        ("no_such_package.engines:Engine", "cannot import module 'no_such_package.engines'"),
    ],
)
def test_a_bad_engine_is_refused_with_the_option_named(name, message):
    with pytest.raises(ValueError, match="model.engine.name") as error:
        check_module_options("troll", AdvantageConfig(), 8, EngineConfig(name))
    assert message in str(error.value)


class OldSignature(HFEngine):
    """An engine written against 0.1's ``generate``: the request's fields one by one."""

    def generate(self, snapshot, prompt_ids, group_size, sampling, pad_id, stop_ids,
                 recorder=None, budgets=None):  # fmt: skip
        raise AssertionError("never called: the engine is refused when it is named")


def test_an_engine_written_against_the_old_generate_is_refused_before_the_model_loads():
    """The checks made before anything loads (and every build of the engine, in a process of
    its own too) refuse it in one line that says how to write ``generate`` now."""
    from lightning_troll.engines.process import ProcessEngine

    name = "tests.test_engines:OldSignature"
    fix = "write it as generate(self, snapshot, request, recorder=None)"
    with pytest.raises(ValueError, match=r"model\.engine\.name='tests\.test_engines:Old") as error:
        check_module_options("troll", AdvantageConfig(), 8, EngineConfig(name))
    message = str(error.value)
    assert "\n" not in message and fix in message and "CHANGELOG.md" in message
    assert "tests.test_engines.OldSignature.generate takes prompt_ids" in message
    context = EngineContext("tinymath", "float32", None)
    with pytest.raises(ValueError, match=re.escape(fix)):
        build_engine(name, context)
    with pytest.raises(ValueError, match=re.escape(fix)):
        ProcessEngine(context, inner=name)
    assert engine_class("tests.test_engines:CountingEngine") is CountingEngine  # *args: accepted


def test_a_request_keeps_its_fields_as_tuples_and_is_equal_to_the_same_request():
    from lightning_troll.engines.sampling import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=6)
    request = SampleRequest([[1, 2], [3]], 2, sampling, 0, [7, 8], budgets=[6, 1])
    assert request.prompt_ids == ((1, 2), (3,)) and request.stop_ids == (7, 8)
    assert request.budgets == (6, 1) and request.each_budget == (6, 1)
    assert request == SampleRequest(((1, 2), (3,)), 2, sampling, 0, (7, 8), (6, 1))
    assert request != replace(request, budgets=None)
    assert SampleRequest([[1], [2], [3]], 1, sampling, 0, [7]).each_budget == (6, 6, 6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"budgets": [3]},
            "budgets must be 2 integers (one per prompt) from 1 to max_new_tokens 6",
        ),
        ({"budgets": [3, 0]}, "budgets must be 2 integers"),
        ({"budgets": [3, 7]}, "from 1 to max_new_tokens 6; got [3, 7]"),
        ({"budgets": [3, True]}, "budgets must be 2 integers"),
        ({"budgets": [3, 2.0]}, "budgets must be 2 integers"),
        ({"group_size": 0}, "group_size must be an integer >= 1; got 0"),
        ({"group_size": True}, "group_size must be an integer >= 1; got True"),
    ],
)
def test_a_request_is_checked_when_it_is_built(changes, message):
    from lightning_troll.engines.sampling import SamplingConfig

    fields = {"prompt_ids": [[1, 2], [3]], "group_size": 2, "sampling": SamplingConfig(
        max_new_tokens=6), "pad_id": 0, "stop_ids": [7]}  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        SampleRequest(**{**fields, **changes})


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_vllm_without_vllm_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"make setup-vllm"):
        check_module_options("troll", AdvantageConfig(), 8, EngineConfig("vllm"))


def test_engine_options_are_checked():
    context = EngineContext("tinymath", "float32", None)
    with pytest.raises(ValueError, match=r"the hf engine takes no options; got \['kv_cache'\]"):
        build_engine("hf", context, {"kv_cache": 1})
    with pytest.raises(ValueError, match=r"engine.options for .*unexpected keyword"):
        build_engine("tests.test_engines:CountingEngine", context, {"colour": "red"})
    engine = build_engine("tests.test_engines:CountingEngine", context, {"tag": "x"})
    assert isinstance(engine, RolloutEngine) and engine.tag == "x" and engine.stale


@pytest.mark.slow
def test_a_users_engine_samples_every_rollout_and_takes_weights_after_each_refresh(
    tmp_path, tiny_model_dir
):
    from tests.test_training import fit, make_module

    CountingEngine.instances.clear()
    module = make_module(
        tiny_model_dir,
        engine=EngineConfig("tests.test_engines:CountingEngine", {"tag": "run"}),
    )
    trainer, module, recorder = fit(tmp_path, tiny_model_dir, max_steps=3, module=module)
    engine = module.engine
    assert engine is CountingEngine.instances[-1] and engine.tag == "run"
    assert engine.generated == 3
    # before the first rollout, and after the refresh that follows each of the first two
    assert engine.loads == [0, 1, 2]
    assert trainer.callback_metrics["engine/calls"] == 3.0
    assert "rollout/engine_logprob_diff" not in trainer.callback_metrics  # it reports none


def test_module_refuses_an_unknown_engine_before_the_model_loads(monkeypatch):
    import lightning_troll.training.module as module_file
    import lightning_troll.training.policies as policies_file

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded before the engine was checked")

    monkeypatch.setattr(policies_file, "load_policy", no_loading)
    with pytest.raises(ValueError, match="model.engine.name must be one of"):
        module_file.TrollModule(model="tinymath", engine=EngineConfig("sglang"))


# -- the weights an engine takes ------------------------------------------------------------------


def _tiny(tie: bool = True):
    model = tiny_causal_lm(vocab_size=17, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    if not tie:  # a head of its own
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.1)
        model.config.tie_word_embeddings = False
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_full_weights_of_a_plain_model_name_every_parameter_as_transformers_does(tie):
    model = _tiny(tie)
    given = dict(full_weights(model))
    expected = dict(model.named_parameters(remove_duplicate=False))
    assert set(given) == set(expected) and "lm_head.weight" in given
    for name, value in expected.items():
        assert torch.equal(given[name], value.detach()), name
    same = given["lm_head.weight"].data_ptr() == given["model.embed_tokens.weight"].data_ptr()
    assert same == tie  # a tied head is the embedding itself, not a copy


def test_full_weights_of_a_lora_model_are_its_merged_weights():
    peft = pytest.importorskip("peft")
    model = _tiny(tie=False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # B starts at zero: make the update visible
    given = dict(full_weights(lora))
    merged = copy.deepcopy(lora).merge_and_unload()
    expected = dict(merged.named_parameters(remove_duplicate=False))
    assert set(given) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(given[name], value.detach(), rtol=1e-6, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = lora.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(given[q], base)  # the update is in


def test_full_weights_of_an_int8_copy_are_its_dequantised_weights():
    model = _tiny(tie=True)
    quantized = quantize_int8_(copy.deepcopy(model))
    given = dict(full_weights(quantized))
    assert set(given) == set(dict(model.named_parameters(remove_duplicate=False)))
    for name, value in model.named_parameters():
        error = (given[name] - value.detach()).abs()
        if value.dim() == 2:  # quantised per row: within half a step of each row's scale
            step = value.detach().abs().amax(dim=1, keepdim=True) / 127
            assert bool((error <= step / 2 + 1e-7).all()), name
            assert given[name].dtype == torch.float32
        else:
            assert torch.equal(given[name], value.detach()), name


class ShiftedEngine(HFEngine):
    """Samples as the HF engine does, but reports log-probs shifted from the snapshot's by a known
    amount (+0.3 at even response positions, -0.2 at odd): a sampler that disagrees with the
    trainer, as vLLM's kernels may."""

    name = "shifted"
    records_behaviour = False

    def generate(self, snapshot, request, recorder=None):
        from lightning_troll.rollouts.forward import behaviour_outputs

        g = super().generate(snapshot, request)
        true, _ = behaviour_outputs(
            snapshot, g.input_ids, g.attention_mask, g.response_mask, request.sampling.temperature,
            None, None, False,
        )  # fmt: skip
        return Generation(*[getattr(g, f) for f in ("input_ids", "attention_mask", "response_mask",
                                                    "truncated")],
                          logprobs=(true + shifts(g.response_mask)) * g.response_mask)  # fmt: skip


def shifts(mask):
    positions = torch.arange(mask.shape[1])
    return torch.where(positions % 2 == 0, 0.3, -0.2).expand(mask.shape)


@pytest.mark.slow
def test_truncated_importance_weights_scale_each_tokens_advantage(tmp_path, tiny_model_dir):
    from lightning_troll.objectives import CorrectionsConfig
    from tests.test_training import fit, make_module

    module = make_module(
        tiny_model_dir,
        engine=EngineConfig("tests.test_engines:ShiftedEngine"),
        corrections=CorrectionsConfig(engine_is_cap=1.1),
    )
    trainer, module, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module)
    metrics = trainer.callback_metrics
    torch.testing.assert_close(float(metrics["rollout/engine_logprob_diff"]),
                               float(shifts(torch.ones(1, 64)).abs().mean()), atol=0.03, rtol=0)  # fmt: skip
    for rollout in recorder.rollouts:
        mask = rollout.response_mask
        assert rollout.advantages.shape == mask.shape  # per token now
        weights = torch.exp(-shifts(mask)).clamp(max=1.1) * mask  # 0.741 even, 1.1 (capped) odd
        per_sequence = rollout.advantages.sum(-1) / (weights.sum(-1))  # the group advantage
        torch.testing.assert_close(
            rollout.advantages, per_sequence[:, None] * weights, atol=1e-5, rtol=1e-5
        )
        assert bool((per_sequence.view(-1, 4).sum(-1).abs() < 1e-4).all())  # GRPO: mean zero
    capped = float(metrics["rollout/engine_is_capped_frac"])
    assert 0.3 < capped < 0.7  # the odd positions


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "figure", "share"),
    [
        # even positions (ratio 0.741) fall below the floor, odd ones (1.221) stay with their ratio
        ({"engine_is_cap": 1.3, "engine_is_mode": "mask", "engine_is_floor": 0.8},
         "rollout/engine_is_masked_frac", (0.3, 0.7)),
        # one weight per completion: the product of its tokens' ratios, capped
        ({"engine_is_cap": 1.1, "engine_is_level": "sequence"}, "rollout/engine_is_capped_frac",
         (0.0, 1.0)),
    ],
)  # fmt: skip
def test_masked_and_sequence_weights_scale_each_tokens_advantage(
    tmp_path, tiny_model_dir, options, figure, share
):
    from lightning_troll.objectives import CorrectionsConfig
    from tests.test_training import fit, make_module

    corrections = CorrectionsConfig(**options)
    module = make_module(
        tiny_model_dir,
        engine=EngineConfig("tests.test_engines:ShiftedEngine"),
        corrections=corrections,
    )
    trainer, module, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module)
    for rollout in recorder.rollouts:
        sampled = rollout.attention_mask[:, rollout.prompt_length :].bool()  # every response token
        mask = rollout.response_mask
        ratios = torch.exp(-shifts(mask))
        if corrections.engine_is_level == "sequence":
            product = torch.exp(-(shifts(mask) * mask).sum(-1, keepdim=True))
            weights = product.clamp(max=corrections.engine_is_cap).expand_as(mask) * mask
            assert torch.equal(mask, sampled)  # truncating keeps every token in the loss
        else:
            band = (ratios >= corrections.engine_is_floor) & (ratios <= corrections.engine_is_cap)
            weights = torch.where(band, ratios, 0.0) * mask
            # a masked token leaves the loss: the response mask, the old rows and log-probs
            assert torch.equal(mask, sampled & band) and bool((sampled & ~band).any())
            assert rollout.old.indices.shape[0] == int(mask.sum())
            assert bool((rollout.old_logprobs[~mask] == 0).all())
        kept = weights.sum(-1) > 0
        per_sequence = rollout.advantages.sum(-1) / weights.sum(-1).clamp_min(1e-12)
        torch.testing.assert_close(
            rollout.advantages, per_sequence[:, None] * weights, atol=1e-5, rtol=1e-5
        )
        assert bool(kept.any())  # a one-token completion at an even position is masked whole
        whole = kept.view(-1, 4).all(-1)  # groups none of whose completions was masked whole
        sums = per_sequence.view(-1, 4).sum(-1).abs()
        assert bool(whole.any()) and bool((sums[whole] < 1e-4).all())  # GRPO: mean zero
    low, high = share
    assert low <= float(trainer.callback_metrics[figure]) <= high


def test_importance_weights_need_an_engine_that_samples_apart(tiny_model_dir):
    from lightning_troll.objectives import CorrectionsConfig
    from tests.test_training import make_module

    with pytest.raises(ValueError, match=r"engine_is_cap=2.0 .* the 'hf' engine samples with"):
        make_module(tiny_model_dir, corrections=CorrectionsConfig(engine_is_cap=2.0))
    with pytest.raises(
        ValueError, match=r"model.corrections.engine_is_cap must be a finite number >= 1 .* or null"
    ):
        CorrectionsConfig(engine_is_cap=0.5)
    with pytest.raises(ValueError, match=r"engine_is_cap=2.0 .* the 'hf' engine samples with"):
        make_module(
            tiny_model_dir, corrections=CorrectionsConfig(engine_is_cap=2.0, engine_is_mode="mask")
        )
    # in a process of its own the HF engine still samples with the snapshot's weights
    with pytest.raises(ValueError, match=r"the 'hf' engine \(in a process of its own\) samples"):
        make_module(
            tiny_model_dir,
            engine=EngineConfig(options={"process": True}),
            corrections=CorrectionsConfig(engine_is_cap=2.0),
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_cache_gib": "2"}, r"kv_cache_gib must be a number > 0 \(GiB\); got '2'"),
        ({"kv_cache_gib": 0}, r"kv_cache_gib must be a number > 0 \(GiB\); got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be a number in \(0, 1\]; got 1.5"),
        ({"max_model_len": 0}, r"max_model_len must be null or an integer >= 1; got 0"),
        ({"enforce_eager": "no"}, r"enforce_eager must be true or false; got 'no'"),
        ({"llm_kwargs": ["seed"]}, r"llm_kwargs must be null or a mapping of vLLM's LLM arguments; "
                                   r"got \['seed'\]"),
    ],
)  # fmt: skip
def test_vllm_options_are_refused_from_the_options_alone(options, message):
    """Checked before the model loads, whether or not vLLM is installed here."""
    from lightning_troll.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"^model\.engine\.options\." + message + "$"):
        VLLMEngine.check_options(options)
    with pytest.raises(ValueError, match=r"^model.engine.options for 'vllm': .*'kv_cache'"):
        VLLMEngine.check_options({"kv_cache": 1})
    VLLMEngine.check_options({"kv_cache_gib": 2, "max_model_len": 512})


def test_an_engine_for_one_process_is_refused_in_a_run_of_several():
    """A user's engine that cannot share a run with other processes is refused at setup, before
    any rollout; the built-in engines both serve DDP and FSDP2."""

    from lightning_troll.engines.vllm import VLLMEngine
    from lightning_troll.training.rollout_parts import check_engine_processes

    class OneProcess(CountingEngine):
        several_processes = False

    assert HFEngine.several_processes and VLLMEngine.several_processes
    engine = OneProcess.__new__(OneProcess)
    with pytest.raises(ValueError, match=r"runs in a single process; this run has 2"):
        check_engine_processes(engine, 2)
    check_engine_processes(engine, 1)  # one process: accepted


class SeededLLM:
    """Stands in for vLLM's ``LLM``: each request samples from a generator of its own, seeded
    with its ``SamplingParams.seed``, and its ``k``-th completion with ``seed + k``, as vLLM
    seeds a request's completions. It records the seeds it was given."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def generate(self, requests, params, use_tqdm=False):
        from types import SimpleNamespace

        assert len(params) == len(requests)  # one SamplingParams per request
        outputs = []
        for request, p in zip(requests, params, strict=True):
            completions = []
            for k in range(p.n):
                self.seeds.append(p.seed + k)
                draws = torch.Generator().manual_seed(p.seed + k)
                tokens = torch.randint(10, 1000, (p.max_tokens,), generator=draws).tolist()
                entries = [{t: SimpleNamespace(logprob=-1.0)} for t in tokens]
                completions.append(SimpleNamespace(index=k, token_ids=tokens, logprobs=entries))
            outputs.append(SimpleNamespace(outputs=completions, prompt=request))
        return outputs


def test_a_vllm_request_samples_up_to_its_prompts_own_budget(monkeypatch):
    """Each request's ``max_tokens`` is its prompt's budget. A completion shorter than the longest
    is padded, and its padding is no response token even where the pad id is a stop token:
    each is truncated at its own budget."""
    import sys
    from types import SimpleNamespace

    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.engines.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=SimpleNamespace))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._llm, engine.stale, engine._figures = SeededLLM(), False, {}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    request = SampleRequest([[1, 2, 3], [4], [6, 7]], 2, sampling, 5, [5], budgets=[2, 6, 4])
    out = engine.generate(torch.nn.Linear(2, 2), request)
    # SeededLLM writes tokens 10 to 999: 5, the pad, is a stop it never writes
    assert out.response_mask.sum(-1).tolist() == [2, 2, 6, 6, 4, 4]
    assert out.truncated.all()
    assert out.logprobs[out.response_mask].eq(-1.0).all()
    assert out.logprobs[~out.response_mask].eq(0.0).all()


def test_every_request_and_completion_of_a_vllm_call_samples_from_a_seed_of_its_own(monkeypatch):
    """Two identical prompts (the episodes of a group send theirs as requests of their own, turn
    by turn) must not sample the same completions: every request gets a seed of its own from the
    one draw of the trainer's generator, and a seeded call samples the same completions again."""
    import sys
    from types import SimpleNamespace

    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.engines.vllm import VLLMEngine, request_seeds

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=SimpleNamespace))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._llm, engine.stale, engine._figures = SeededLLM(), False, {}
    snapshot = torch.nn.Linear(2, 2)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]

    def sample(group: int) -> Generation:
        torch.manual_seed(11)
        return engine.generate(snapshot, SampleRequest(prompts, group, sampling, 0, [999]))

    first = sample(2)
    rows = {tuple(row.tolist()) for row in first.input_ids}
    assert len(rows) == 6  # two identical prompts x two completions each: all apart
    seeds = engine._llm.seeds
    assert len(set(seeds)) == len(seeds) == 6
    assert torch.equal(sample(2).input_ids, first.input_ids)  # seeded: the same again
    assert request_seeds(100, 3, 4) == [100, 104, 108]  # completions 100-103, 104-107, 108-111
    ones = sample(1).input_ids[:2, 3:]  # group size 1, as an episode's turn: still apart
    assert not torch.equal(ones[0], ones[1])


def test_an_option_the_engine_ignores_is_warned_of_at_the_start():
    """``decode: graphs`` is the HF engine's; ``behaviour_logprobs: sampling`` needs an engine
    that records while it samples in the trainer's process: elsewhere each is said, not dropped
    in silence."""
    from types import SimpleNamespace

    from lightning_troll.callbacks import RolloutGeneration
    from lightning_troll.engines.sampling import SamplingConfig
    from lightning_troll.training.rollout_parts import engine_warnings

    assert engine_warnings("hf", None, "graphs", "sampling") == []
    assert engine_warnings("hf", {"process": True}, "graphs", "auto") == []
    assert engine_warnings("tests.test_engines:CountingEngine", None, "auto", "forward") == []
    (decode, behaviour) = engine_warnings("vllm_server", None, "graphs", "sampling")
    assert decode.startswith("model.sampling.decode='graphs' is the hf engine's; the 'vllm_server'")
    assert behaviour.startswith(
        "model.engine.behaviour_logprobs='sampling': the 'vllm_server' engine"
    )
    (behaviour,) = engine_warnings("hf", {"process": True}, "auto", "sampling")
    assert "the 'hf' engine in a process of its own does not record" in behaviour
    assert engine_warnings("hf", None, "auto", "forward", 8) == []
    (every,) = engine_warnings("hf", None, "dynamic", "forward", 8)
    assert (
        every == "model.sampling.check_every=8 is the hf engine's CUDA-graph path's; the "
        "dynamic loop ignores it"
    )
    (every,) = engine_warnings("vllm_server", None, "auto", "forward", 2)
    assert every.endswith("path's; the 'vllm_server' engine ignores it")
    assert engine_warnings("hf", None, "auto", "forward", 1, True) == []
    (compiled,) = engine_warnings("hf", None, "dynamic", "forward", 1, True)
    assert compiled == (
        "model.sampling.compile_step=true is the hf engine's CUDA-graph path's; the dynamic "
        "loop ignores it"
    )
    (every, compiled) = engine_warnings("vllm_server", None, "auto", "forward", 4, True)
    assert compiled.endswith("path's; the 'vllm_server' engine ignores it")

    module = SimpleNamespace(
        engine_config=EngineConfig("hf", {"process": True}, "sampling"),
        sampling=SamplingConfig(decode="graphs"),
        episodes=None,
        dynamic_sampling=None,
    )
    with pytest.warns(UserWarning, match=r"behaviour_logprobs='sampling': the 'hf' engine in a"):
        RolloutGeneration().setup(None, module, "fit")
