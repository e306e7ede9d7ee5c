"""The behaviour policy's log-probs and sparse rows recorded while sampling, against a forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_troll.engines.behaviour import (
    BehaviourRecord,
    BehaviourRecorder,
    behaviour_rows,
    records_while_sampling,
)
from lightning_troll.engines.sampling import SamplingConfig, sample
from lightning_troll.rollouts.rollout import behaviour_outputs
from lightning_troll.training.module import DynamicSamplingConfig, EngineConfig
from lightning_troll.trust_region.projection import SparseDistribution, sparsify

PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 6]]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def sparse_fn(logits, tokens, reads=True):
    return sparsify(logits, max_tokens=6, mass_delta=1e-3, keep=tokens, reads=reads)


def dense(old: SparseDistribution) -> torch.Tensor:
    """(N, V) probabilities of the kept tokens (0 elsewhere), for comparing supports."""
    out = torch.zeros(old.num_rows, old.vocab_size, dtype=torch.float64)
    rows = torch.arange(old.num_rows).unsqueeze(-1).expand_as(old.indices)
    keep = old.mask
    out[rows[keep], old.indices[keep]] = old.logprobs[keep].double().exp()
    return out


def recorded_and_forward(model, sampling, sparsify_fn, seed=0, read_free=None):
    torch.manual_seed(seed)
    recorder = BehaviourRecorder(sampling.temperature, sparsify_fn, read_free=read_free)
    ids, attention, response, _ = sample(model, PROMPTS, 4, sampling, 0, 2, recorder=recorder)
    record = recorder.finish(ids[:, -response.shape[1] :])
    recorded = record.outputs(response)
    forward = behaviour_outputs(model, ids, attention, response, sampling.temperature, sparsify_fn)
    return response, recorded, forward


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7, max_new_tokens=6),
        # top-p and top-k act after the recorder: it still sees the untruncated distribution
        SamplingConfig(temperature=1.3, top_p=0.8, top_k=5, max_new_tokens=6),
    ],
)
@pytest.mark.parametrize("read_free", [False, True], ids=["reading", "read-free"])
def test_recorded_rows_equal_the_forward_pass(model, sampling, read_free):
    """Token log-probs and sparse rows kept while sampling are those a teacher-forced pass of
    the same model computes (float32: 1e-5), row for row in the order of the response mask,
    whether the recorder reads from the device at each step or not (as on a GPU)."""
    response, (logp, old), (logp_ref, old_ref) = recorded_and_forward(
        model, sampling, sparse_fn, read_free=read_free
    )
    assert response.sum() > len(PROMPTS) * 4  # more than one token per completion
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)
    assert (logp[~response] == 0).all()
    assert old.num_rows == old_ref.num_rows == int(response.sum())
    torch.testing.assert_close(dense(old), dense(old_ref), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        old.tail_logmass.exp(), old_ref.tail_logmass.exp(), atol=1e-6, rtol=0
    )


def test_log_probs_only_without_a_sparsify_function(model):
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=5)
    response, (logp, old), (logp_ref, old_ref) = recorded_and_forward(model, sampling, None)
    assert old is None and old_ref is None
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)


def test_recording_does_not_change_what_is_sampled(model):
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=6)
    torch.manual_seed(3)
    plain = sample(model, PROMPTS, 4, sampling, 0, 2)[0]
    torch.manual_seed(3)
    recorded = sample(model, PROMPTS, 4, sampling, 0, 2, recorder=BehaviourRecorder(0.7))[0]
    assert torch.equal(plain, recorded)


def record(logprobs, indices=None, sparse_logprobs=None, tail=None, vocab=10):
    return BehaviourRecord(logprobs, indices, sparse_logprobs, tail, vocab)


def test_select_and_cat_keep_each_sequence_row_for_row():
    """Two rounds of different lengths (T 2 and 3) and widths (K 1 and 2): after cat and a
    selection, each sequence's rows are its own, padded with -1 / -inf / 0."""
    inf = float("-inf")
    a = record(
        torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]),
        torch.tensor([[[1], [2]], [[3], [4]]]),
        torch.tensor([[[-0.1], [-0.2]], [[-0.3], [-0.4]]]),
        torch.tensor([[-2.0, -3.0], [-4.0, -5.0]]),
    )
    b = record(
        torch.tensor([[-0.5, -0.6, -0.7]]),
        torch.tensor([[[5, 6], [7, -1], [8, 9]]]),
        torch.tensor([[[-0.5, -1.5], [-0.6, inf], [-0.7, -1.7]]]),
        torch.tensor([[-6.0, -7.0, -8.0]]),
    )
    both = BehaviourRecord.cat([a, b])
    assert both.logprobs.shape == (3, 3) and both.indices.shape == (3, 3, 2)
    assert both.indices[0].tolist() == [[1, -1], [2, -1], [-1, -1]]
    assert both.logprobs[1].tolist() == pytest.approx([-0.3, -0.4, 0.0])
    assert both.tail_logmass[0, 2] == inf
    picked = both.select(torch.tensor([0, 2]))
    mask = torch.tensor([[True, False, False], [True, True, True]])
    logp, old = picked.outputs(mask)
    torch.testing.assert_close(logp, torch.tensor([[-0.1, 0.0, 0.0], [-0.5, -0.6, -0.7]]))
    assert old.indices.tolist() == [[1, -1], [5, 6], [7, -1], [8, 9]]
    assert old.tail_logmass.tolist() == [-2.0, -6.0, -7.0, -8.0]
    assert old.vocab_size == 10


def test_outputs_refuses_a_mask_of_another_shape():
    with pytest.raises(
        ValueError, match=r"response_mask is \(2, 3\) but the record covers \(2, 2\)"
    ):
        record(torch.zeros(2, 2)).outputs(torch.ones(2, 3, dtype=torch.bool))


def test_non_finite_logits_stop_the_recording():
    recorder = BehaviourRecorder(1.0)
    logits = torch.zeros(2, 5)
    logits[1, 3] = float("nan")
    recorder(torch.tensor([[1], [1]]), logits)
    with pytest.raises(FloatingPointError, match=r"generation step 0 for 1 sequences \(first: 1\)"):
        recorder(torch.tensor([[1, 2], [1, 2]]), torch.zeros(2, 5))


def test_finish_refuses_a_step_count_that_does_not_match():
    recorder = BehaviourRecorder(1.0)
    recorder(torch.tensor([[1]]), torch.zeros(1, 5))
    with pytest.raises(RuntimeError, match=r"saw 1 generation steps for 2 generated tokens"):
        recorder.finish(torch.tensor([[3, 4]]))


def recorded_steps(recorder, steps, rows=4, vocab=50, seed=0):
    """``steps`` decoding steps of random logits through ``record_rows``, sequences dropping out
    (one fewer a step, down to one); returns the per-step (logits, tokens, rows) given."""
    g = torch.Generator().manual_seed(seed)
    given = []
    for step in range(steps):
        running = torch.arange(max(rows - step, 1))  # (n,) indices into B
        logits = torch.randn(len(running), vocab, generator=g) * 3
        tokens = torch.randint(0, vocab, (len(running),), generator=g)
        recorder.record_rows(logits, tokens, running)
        given.append((logits, tokens, running))
    return given


@pytest.mark.parametrize("block_bytes", [64 * 2**20, 512], ids=["one-block", "many-blocks"])
def test_cpu_records_live_in_a_few_blocks_and_hold_each_steps_values(monkeypatch, block_bytes):
    """On a CPU each step's record is copied into blocks shared by the steps (so the heap does not
    fill with small records between the steps' large temporaries); a full block starts a new one
    without touching what the old one holds, and the record is the one kept step by step."""
    import lightning_troll.engines.records as records

    monkeypatch.setattr(records, "_BLOCK_BYTES", block_bytes)
    recorder = BehaviourRecorder(0.7, sparse_fn)
    given = recorded_steps(recorder, steps=12)
    kept = recorder._steps
    storages = {t.untyped_storage().data_ptr() for logp, sparse, rows in kept
                for t in (logp, rows, sparse.indices, sparse.logprobs, sparse.tail_logmass)}  # fmt: skip
    assert len(storages) == 2 if block_bytes > 2**20 else len(storages) > 2  # int64, float32
    for (logits, tokens, running), (logp, sparse, rows) in zip(given, kept, strict=True):
        want_logp, want_sparse, _ = behaviour_rows(logits / 0.7, tokens, sparsify_fn=sparse_fn)
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=0)
        torch.testing.assert_close(rows, running, rtol=0, atol=0)
        for name in ("indices", "logprobs", "tail_logmass"):
            torch.testing.assert_close(
                getattr(sparse, name), getattr(want_sparse, name), rtol=0, atol=0
            )
    record = recorder.finish(torch.zeros(4, 12, dtype=torch.long))
    assert record.logprobs[0].tolist() == [step[0][0].item() for step in kept]
    assert recorder._steps == [] and recorder._store._blocks == {}


# --------------------------------------------------------------------------------------------
# Through the module and the rollout callback
# --------------------------------------------------------------------------------------------


def both_ways(model_dir, **options):
    """The same rollout (same seed) with the behaviour log-probs recorded and recomputed."""
    from tests.test_dynamic_sampling import collect

    return {
        mode: collect(model_dir, engine=EngineConfig(behaviour_logprobs=mode), **options)
        for mode in ("sampling", "forward")
    }


@pytest.mark.parametrize(
    "options",
    [
        {"objective": "troll"},
        {"objective": "clip"},
        # several rounds of different lengths, groups left out, truncated rows masked
        {
            "objective": "troll",
            "rewards": {"tests.reward_helpers:used_the_budget": 1.0},
            "dynamic_sampling": DynamicSamplingConfig(max_rounds=6),
            "more": True,
            "seed": 1,
            "loss": "mask_truncated",
        },
    ],
    ids=["troll", "clip", "dynamic-sampling-masked"],
)
def test_rollouts_recorded_while_sampling_equal_recomputed_ones(tiny_model_dir, options):
    from lightning_troll.training.module import CorrectionsConfig

    options = dict(options)
    if options.pop("loss", None):
        options["corrections"] = CorrectionsConfig(mask_truncated=True)
    runs = both_ways(tiny_model_dir, **options)
    (_, recorded, report), (_, forward, _) = runs["sampling"], runs["forward"]
    if options.get("more"):
        assert len(report.rounds) > 1
    assert torch.equal(recorded.input_ids, forward.input_ids)
    assert torch.equal(recorded.response_mask, forward.response_mask)
    torch.testing.assert_close(recorded.old_logprobs, forward.old_logprobs, rtol=0, atol=1e-5)
    if options["objective"] == "clip":
        assert recorded.old is None and forward.old is None
    else:
        assert recorded.old.num_rows == forward.old.num_rows == int(recorded.response_mask.sum())
        torch.testing.assert_close(dense(recorded.old), dense(forward.old), rtol=0, atol=1e-5)
    seconds = report.seconds
    assert set(seconds) == {"generation", "forward_passes", "rollout"}
    assert 0 < seconds["generation"] <= seconds["rollout"]
    assert 0 <= seconds["forward_passes"] <= seconds["rollout"]


def test_a_bad_behaviour_logprobs_option_is_named(tiny_model_dir):
    from tests.test_training import make_module

    with pytest.raises(
        ValueError,
        match=r"model.engine.behaviour_logprobs must be one of \['auto', 'forward', 'sampling'\]; got "
        r"'cached'",
    ):
        make_module(tiny_model_dir, engine=EngineConfig(behaviour_logprobs="cached"))


@pytest.mark.parametrize(
    ("option", "dtype", "expected"),
    [
        ("auto", torch.float32, True),
        ("auto", torch.float64, True),
        ("auto", torch.bfloat16, False),
        ("auto", torch.float16, False),
        ("sampling", torch.bfloat16, True),
        ("forward", torch.float32, False),
    ],
)
def test_auto_records_while_sampling_only_in_full_precision(model, option, dtype, expected):
    import copy

    policy = copy.deepcopy(model).to(dtype)
    assert records_while_sampling(option, policy) is expected


@pytest.mark.parametrize(("dtype", "recomputed"), [("float32", False), ("bfloat16", True)])
def test_the_default_recomputes_the_behaviour_pass_of_a_bfloat16_policy(
    tiny_model_dir, monkeypatch, dtype, recomputed
):
    """``auto`` (the default): a float32 policy's rollout keeps what sampling recorded, a bfloat16
    policy's runs the teacher-forced pass of the snapshot after sampling."""
    import lightning_troll.rollouts.collector as rollout_callback
    from tests.test_dynamic_sampling import collect

    calls = []
    original = rollout_callback.behaviour_outputs

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(rollout_callback, "behaviour_outputs", counted)
    module, rollout, _ = collect(tiny_model_dir, dtype=dtype)
    assert module.engine_config.behaviour_logprobs == "auto"
    assert len(calls) == (1 if recomputed else 0)
    assert rollout.old.num_rows == int(rollout.response_mask.sum())
    assert torch.isfinite(rollout.old_logprobs[rollout.response_mask]).all()


@pytest.mark.slow
def test_a_fit_logs_where_the_time_goes(tmp_path, tiny_model_dir):
    """Per rollout: generation and the passes after it fit in the rollout's time; training and
    throughput are positive; generation and training time are in the progress bar."""
    from pathlib import Path

    from lightning.pytorch.loggers import CSVLogger

    from tests.test_resume import logged
    from tests.test_training import fit

    trainer, _, _ = fit(tmp_path, tiny_model_dir, max_steps=3, logger=CSVLogger(tmp_path))
    rows = [r for r in logged(Path(trainer.logger.log_dir)).values() if "time/rollout" in r]
    assert len(rows) == 3
    for row in rows:
        generation, passes = row["time/generation"], row["time/forward_passes"]
        assert generation > 0 and passes >= 0 and generation + passes <= row["time/rollout"]
        assert row["time/training"] > 0 and row["throughput/generated_tokens_per_s"] > 0
    assert {"time/generation", "time/training"} <= set(trainer.progress_bar_metrics)
