"""The two side measurements of ``examples/benchmark_iteration.py``, on one rollout of its prompts:

- ``--behaviour-error``: :func:`behaviour_error`, the behaviour log-probs and sparse rows recorded
  while sampling against a teacher-forced pass of the same weights;
- ``--generation``: :func:`generation_speed`, response tokens per second of ``generate`` with a
  dynamic and with a static KV cache.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iteration_workers import GROUP, TEMPERATURE, chat_prompt_ids  # noqa: E402

# ------------------------------------------------------- recorded against recomputed log-probs


def behaviour_error(model_dir: str, dtype: str, threads: int, max_new_tokens: int) -> dict:
    """How far the behaviour log-probs and sparse rows recorded while sampling are from a
    teacher-forced forward pass of the same model, on one rollout of the benchmark's prompts.

    Returns the largest and mean absolute difference of the sampled tokens' log-probs (and so
    the largest on-policy ratio error ``exp(max) - 1``), and the largest total-variation distance
    between the two sparse distributions of a token (kept tokens and tail mass).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_troll.engines.behaviour import BehaviourRecorder
    from lightning_troll.engines.sampling import SamplingConfig, sample
    from lightning_troll.models import stop_token_ids
    from lightning_troll.rollouts.rollout import behaviour_outputs
    from lightning_troll.trust_region.sparse import sparsify

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tokenizer)

    def fn(logits, tokens):
        return sparsify(logits, max_tokens=64, mass_delta=1e-5, keep=tokens)

    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens)
    recorder = BehaviourRecorder(TEMPERATURE, fn)
    pad, stops = tokenizer.pad_token_id, stop_token_ids(tokenizer, model)
    ids, attention, response, _ = sample(
        model, prompts, GROUP, sampling, pad, stops, recorder=recorder
    )
    logp, old = recorder.finish(ids[:, -response.shape[1] :]).outputs(response)
    logp_ref, old_ref = behaviour_outputs(model, ids, attention, response, TEMPERATURE, fn, 256)
    diff = (logp - logp_ref)[response].abs()

    def dense(sparse):  # (N, V + 1): kept tokens' probabilities, then the tail mass
        out = torch.zeros(sparse.num_rows, sparse.vocab_size + 1)
        rows = torch.arange(sparse.num_rows).unsqueeze(-1).expand_as(sparse.indices)
        keep = sparse.mask
        out[rows[keep], sparse.indices[keep]] = sparse.logprobs[keep].float().exp()
        out[:, -1] = sparse.tail_logmass.float().exp()
        return out

    tv = 0.5 * (dense(old) - dense(old_ref)).abs().sum(-1)  # (N,)
    return {
        "dtype": dtype,
        "tokens": int(response.sum()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "max_ratio_error": float(diff.max().exp() - 1),
        "max_total_variation": float(tv.max()),
    }


# ------------------------------------------------------------------------------- generation


def engine_ways(model, model_dir, tokenizer, stops, max_new_tokens) -> dict:
    """The rollout engines as timed ways: the HF engine, and the vLLM engine where vLLM imports
    (its start-up and first weight push happen here, before any timing)."""
    from importlib.util import find_spec

    from lightning_troll.engines.base import EngineContext, SampleRequest, build_engine
    from lightning_troll.engines.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens)
    prompts = chat_prompt_ids(tokenizer)
    request = SampleRequest(prompts, GROUP, sampling, tokenizer.pad_token_id, stops)
    context = EngineContext(model_dir, "float32", tokenizer)
    names = {"hf": "HF engine (model.engine.name: hf)"}
    if find_spec("vllm") is not None:
        names["vllm"] = "vLLM engine (model.engine.name: vllm)"
    ways = {}
    for engine_name, label in names.items():
        engine = build_engine(engine_name, context)
        engine.load_weights(model)

        def run(engine=engine) -> int:
            made = engine.generate(model, request)
            return int(made.response_mask.sum())

        ways[label] = run
    return ways


def generation_speed(model_dir: str, threads: int, max_new_tokens: int, repeats: int) -> list:
    """Response tokens per second of one rollout's generation (the benchmark's 64 sequences) by
    ``generate`` with its dynamic KV cache and with a static cache, and by the rollout engines
    (:func:`engine_ways`), each ``repeats`` times interleaved after one warm-up; the median is
    reported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from lightning_troll.engines.sampling import left_pad
    from lightning_troll.models import stop_token_ids

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [ids for ids in chat_prompt_ids(tokenizer) for _ in range(GROUP)]
    stops = stop_token_ids(tokenizer, model)
    config = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=None,
        top_p=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )

    def padded(cache: str | None) -> int:
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        config.cache_implementation = cache
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        new = out[:, ids.shape[1] :]
        done = torch.isin(new, torch.tensor(stops)).long().cumsum(-1)
        return int(((done == 0) | ((done == 1) & torch.isin(new, torch.tensor(stops)))).sum())

    ways = {"generate, dynamic cache": lambda: padded(None)}
    ways["generate, static cache"] = lambda: padded("static")
    ways.update(engine_ways(model, model_dir, tokenizer, stops, max_new_tokens))
    times: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[int]] = {name: [] for name in ways}
    errors: dict[str, str] = {}
    for attempt in range(repeats + 1):
        for name, run in ways.items():
            if name in errors:
                continue
            torch.manual_seed(attempt)
            start = time.perf_counter()
            try:
                count = run()
            except Exception as error:  # a way this transformers or device does not support
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                continue
            if attempt:  # the first round warms up
                times[name].append(time.perf_counter() - start)
                tokens[name].append(count)
    rows = []
    for name in ways:
        if name in errors:
            rows.append({"way": name, "error": errors[name]})
            continue
        speed = statistics.median(t / s for t, s in zip(tokens[name], times[name], strict=True))
        rows.append(
            {
                "way": name,
                "seconds": statistics.median(times[name]),
                "tokens": statistics.median(tokens[name]),
                "tokens_per_s": speed,
            }
        )
    return rows
