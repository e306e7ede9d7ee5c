"""An engine in its own process (``model.engine.options.process: true``): it samples what
the engine in the trainer's process samples, and with ``old_policy.max_staleness`` it samples
the next rollout while the trainer trains, with the weights the staleness asks for."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from lightning.pytorch import Callback

from lightning_troll.callbacks import OldPolicyRefresh, RolloutGeneration
from lightning_troll.engines.base import SampleRequest
from lightning_troll.engines.hf import HFEngine
from lightning_troll.engines.process import ProcessEngine, fingerprint
from lightning_troll.models.weights import full_weights
from lightning_troll.training.module import EngineConfig
from lightning_troll.training.rollout_parts import engine_in_a_process
from tests.test_training import make_data, make_module, make_trainer


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: w.detach().clone() for name, w in full_weights(module)}


@pytest.mark.slow  # starts a Python process
def test_the_engine_apart_samples_what_the_engine_here_samples(tiny_model_dir):
    module = make_module(tiny_model_dir)
    snapshot, collector = module.old_policy, module.collector
    prompts = [[5, 6, 7], [8, 9]]
    options = (4, collector.sampling, collector.pad_id, collector.stop_ids)
    engine = engine_in_a_process("hf", module.engine.context, {"process": True})
    assert isinstance(engine, ProcessEngine) and not engine.records_behaviour

    def both(seed: int, budgets=None):
        request = SampleRequest(prompts, *options, budgets=budgets)
        torch.manual_seed(seed)
        got = engine.generate(snapshot, request)
        torch.manual_seed(seed)
        seed = int(torch.randint(0, 2**63 - 1, ()))  # what the request drew
        torch.manual_seed(seed)
        here = HFEngine(module.engine.context).generate(snapshot, request)
        for name in ("input_ids", "attention_mask", "response_mask", "truncated"):
            assert torch.equal(getattr(got, name), getattr(here, name)), name
        return got

    try:
        both(3)
        assert engine.last_fingerprint == fingerprint(weights_of(snapshot))
        lengths = both(4, budgets=[1, 3]).response_mask.sum(-1)  # each prompt's own, apart too
        assert lengths[:4].max() <= 1 < lengths[4:].max() <= 3
        figures = engine.figures()
        assert figures["engine/process_prefetched"] == 0.0 and figures["engine/weight_push_s"] > 0
        # new weights: the next sample is theirs
        changed = {k: v + 0.01 for k, v in weights_of(snapshot).items()}
        engine.push(changed, torch.device("cpu"))
        engine.generate(snapshot, SampleRequest(prompts, *options))
        assert engine.last_fingerprint == fingerprint(changed)
    finally:
        engine.close()


class SamplerWeights(Callback):
    """Per rollout: the fingerprint of the snapshot that the trust region is built around, and of
    the weights that sampled the rollout (reported by the engine's process), and its figures."""

    def __init__(self) -> None:
        self.snapshot, self.sampler, self.prefetched = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.snapshot.append(fingerprint(weights_of(pl_module.old_policy)))
        self.sampler.append(pl_module.engine.last_fingerprint)
        self.prefetched.append(float(trainer.callback_metrics["engine/process_prefetched"]))


@pytest.mark.slow  # starts a Python process and trains
@pytest.mark.parametrize(("staleness", "dtype"), [(1, "same"), (2, "same"), (1, "bfloat16")])
def test_the_next_rollout_is_sampled_ahead_by_the_stale_version(
    tmp_path, tiny_model_dir, staleness, dtype
):
    """Every rollout after the first is sampled ahead, while the one before it trained, by the
    weights of the snapshot it then trains against (the version ``max_staleness`` behind), as
    the snapshot holds them: a bfloat16 snapshot's rounded weights."""
    from lightning_troll.models.snapshots import SnapshotConfig

    seen = SamplerWeights()
    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=staleness), seen]
    trainer = make_trainer(tmp_path, 5, callbacks=callbacks, limit_val_batches=0)
    module = make_module(
        tiny_model_dir,
        engine=EngineConfig(options={"process": True}),
        snapshot=SnapshotConfig(dtype=dtype),
    )
    torch.manual_seed(0)
    try:
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    finally:
        module.engine.close()
    assert seen.prefetched == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert seen.sampler == seen.snapshot
    assert len(set(seen.snapshot)) == 5 - staleness  # version 0, then one per rollout
    assert float(trainer.callback_metrics["rollout/staleness"]) == staleness


@pytest.mark.slow  # starts a Python process and trains, three times
def test_a_resume_with_another_staleness_samples_ahead_with_the_weights_due(
    tmp_path, tiny_model_dir
):
    """Stopped after 3 rollouts at max_staleness 2 and resumed with 1; stopped again after 3
    more and resumed with 2: in each resumed run every rollout after the first is still sampled
    ahead, by the snapshot's weights, and the staleness ends at the new setting. One chain of
    three runs resumes both ways, a lower staleness (2 -> 1) and a higher one (1 -> 2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name, staleness, steps, ckpt in (
        ("first", 2, 3, None),
        ("lower", 1, 6, tmp_path / "first" / "step=3.ckpt"),
        ("higher", 2, 9, tmp_path / "lower" / "step=6.ckpt"),
    ):
        seen = SamplerWeights()
        saves = ModelCheckpoint(
            dirpath=tmp_path / name, filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
        refresh = OldPolicyRefresh(max_staleness=staleness)
        callbacks = [RolloutGeneration(log_samples=0), refresh, seen, saves]
        trainer = make_trainer(
            tmp_path, steps, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=True
        )
        module = make_module(tiny_model_dir, engine=EngineConfig(options={"process": True}))
        torch.manual_seed(0)
        try:
            with pytest.warns(UserWarning, match="differs from") if ckpt else nullcontext():
                trainer.fit(module, datamodule=make_data(tiny_model_dir), ckpt_path=ckpt)
        finally:
            module.engine.close()
        if ckpt is not None:
            assert seen.prefetched == [0.0, 1.0, 1.0], name
            assert seen.sampler == seen.snapshot, name
            assert float(trainer.callback_metrics["rollout/staleness"]) == staleness, name


def test_the_process_option_is_checked(tiny_model_dir):
    context = make_module(tiny_model_dir).engine.context
    with pytest.raises(ValueError, match=r"engine.options.process must be true or false"):
        engine_in_a_process("hf", context, {"process": "yes"})
    with pytest.raises(ValueError, match=r"options.threads must be null or an integer >= 1; got 0"):
        engine_in_a_process("hf", context, {"process": True, "threads": 0})
    with pytest.raises(ValueError, match=r"the hf engine takes no options; got \['kv_cache_gib'\]"):
        engine_in_a_process("hf", context, {"process": True, "kv_cache_gib": 1})
    assert engine_in_a_process("hf", context, {}) is None
    assert engine_in_a_process("hf", context, {"process": False}) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("process: true", r"model.engine.options must be null or a mapping of the engine's options; "
                          r"got 'process: true'"),
        ({"process": "yes"}, r"model.engine.options.process must be true or false; got 'yes'"),
        ({"process": True, "threads": 0},
         r"model.engine.options.threads must be null or an integer >= 1; got 0"),
        ({"threads": 2}, r"model.engine.options.threads=2 sets the threads of the engine's own "
                         r"process: it needs model.engine.options.process: true"),
        ({"process": True, "kv_cache_gib": 1},
         r"model.engine.options: the hf engine takes no options; got \['kv_cache_gib'\]"),
    ],
)  # fmt: skip
def test_engine_options_are_refused_before_the_model_loads(options, message):
    """The module checks ``model.engine.options`` first: a model that does not exist would fail
    to load after it."""
    from lightning_troll.training.module import TrollModule

    with pytest.raises(ValueError, match="^" + message + "$"):
        TrollModule(model="/nonexistent/model", engine=EngineConfig(options=options))


def test_process_false_is_the_engine_in_the_trainers_process():
    from lightning_troll.engines.base import EngineContext
    from lightning_troll.objectives import CorrectionsConfig
    from lightning_troll.training.rollout_parts import build_rollout_engine, check_engine

    options = {"process": False}
    check_engine("hf", options, None, CorrectionsConfig())  # was refused as an option of hf's
    engine = build_rollout_engine("hf", options, EngineContext("tinymath", "float32", None))
    assert isinstance(engine, HFEngine) and options == {"process": False}


def test_the_loader_shows_its_next_batch_without_taking_it(tiny_model_dir):
    data = make_data(tiny_model_dir)
    data.setup("fit")
    loader = data.train_dataloader()
    assert data.train_loader is loader and loader.peek() is None  # no pass yet
    batches = iter(loader)
    ahead = loader.peek()
    assert loader.peek() is ahead  # looking twice takes nothing
    first = next(batches)
    assert first is ahead
    second_ahead = loader.peek()
    assert next(batches) is second_ahead
    taken = 2 + sum(1 for _ in batches)
    assert taken == len(loader)  # at the end, peek() shows the next epoch's first batch


def batch_ids(batch) -> list[list[int]]:
    return [list(ids) for ids in batch.prompt_ids]


def test_at_an_epochs_end_the_loader_shows_the_next_epochs_first_batch(tiny_model_dir):
    """Peeking past the last batch of an epoch begins the next epoch's pass: it shows that
    epoch's first batch, and iterating the next epoch yields it and then the rest, the very
    batches a loader nobody peeked into yields."""
    data = make_data(tiny_model_dir, num_train=12)  # 3 batches an epoch
    data.setup("fit")
    loader, plain = data.train_dataloader(), data.train_dataloader()
    expected = []
    for epoch in (0, 1):
        plain.sampler.set_epoch(epoch)
        expected.append([batch_ids(b) for b in plain])
    assert expected[0] != expected[1]  # each epoch its own order

    loader.sampler.set_epoch(0)
    seen = [batch_ids(b) for b in loader]
    ahead = loader.peek()
    assert loader.peek() is ahead and loader.sampler.epoch == 0  # the epoch is left as it was
    assert batch_ids(ahead) == expected[1][0]
    loader.sampler.set_epoch(1)  # as Lightning does before the next pass
    second = iter(loader)
    assert next(second) is ahead
    assert [batch_ids(b) for b in [ahead, *second]] == expected[1] and seen == expected[0]


@pytest.mark.slow  # starts a Python process and trains
def test_the_first_rollout_of_an_epoch_is_sampled_ahead_too(tmp_path, tiny_model_dir):
    """Two batches an epoch, five rollouts: the rollouts that open epochs 2 and 3 are sampled
    ahead like the others, by the weights their trust region is built around."""
    seen = SamplerWeights()
    callbacks = [RolloutGeneration(log_samples=0), OldPolicyRefresh(max_staleness=1), seen]
    trainer = make_trainer(tmp_path, 5, callbacks=callbacks, limit_val_batches=0)
    module = make_module(tiny_model_dir, engine=EngineConfig(options={"process": True}))
    torch.manual_seed(0)
    try:
        trainer.fit(module, datamodule=make_data(tiny_model_dir, num_train=8))
    finally:
        module.engine.close()
    assert len(trainer.datamodule.train_loader) == 2  # rollouts 3 and 5 open epochs 1 and 2
    assert seen.prefetched == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert seen.sampler == seen.snapshot


@pytest.mark.slow  # three Python processes
def test_the_overlap_benchmark_times_both_arms_on_tinymath(tmp_path, capsys):
    """examples/benchmark_overlap.py end to end on TinyMath, its main here and each arm's run the
    script in a fresh process, as always (one optimiser step a rollout, at most 8 new tokens):
    both arms ran their iterations, the figures printed are the JSON's, the overlapped arm
    sampled ahead, and a bad --engine-threads is refused."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "benchmark_overlap.py"
    spec = importlib.util.spec_from_file_location("benchmark_overlap", script)
    overlap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlap)
    out = tmp_path / "overlap.json"
    args = ["--tiny", "--iterations", "3", "--repeats", "1", "--json", str(out)]
    returned = overlap.main([*args, "--steps", "1", "--max-new-tokens", "8"])
    report = json.loads(out.read_text())
    assert returned == report
    assert {arm: len(t) for arm, t in report["times_s"].items()} == {"in turn": 2, "overlapped": 2}
    assert report["ratio"] == pytest.approx(
        report["median_s"]["overlapped"] / report["median_s"]["in turn"]
    )
    assert f"overlapped / in turn: x{report['ratio']:.3f}" in capsys.readouterr().out
    assert report["prefetched"] == {"in turn": 0.0, "overlapped": 1.0}
    assert report["complete"] is True  # a run cut short leaves False, with the runs done
    for arm, times in report["times_s"].items():
        assert [row["total"] for row in report["rows"][arm]] == times
    with pytest.raises(SystemExit) as bad:
        overlap.main(["--engine-threads", "2"])
    assert bad.value.code == 2
    assert "--engine-threads must be in [1, --threads); got 2" in capsys.readouterr().err


@pytest.mark.parametrize("refresh_first", [True, False])
def test_a_stale_run_samples_ahead_in_either_callback_order(
    tmp_path, tiny_model_dir, refresh_first
):
    """The module holds the staleness schedule and RolloutGeneration asks ahead right after it
    collects, so a Trainer of one's own may list OldPolicyRefresh before or after it: each
    rollout after the first is the one asked ahead, sampled by the version the schedule keeps."""
    refresh = OldPolicyRefresh(max_staleness=1)
    callbacks = [refresh, RolloutGeneration(log_samples=0)]
    callbacks = callbacks if refresh_first else callbacks[::-1]
    trainer = make_trainer(tmp_path, 3, callbacks=callbacks, limit_val_batches=0)
    module = make_module(tiny_model_dir, engine=EngineConfig(options={"process": True}))
    asked = []
    submit = module.engine.submit
    module.engine.submit = lambda *a, **k: asked.append(refresh.rollouts) or submit(*a, **k)
    try:
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    finally:
        module.engine.close()
    assert module.staleness is refresh.schedule
    # the first rollout's own request, then after each rollout is collected (before it trains)
    # the next one's, asked ahead; rollouts 2 and 3 are those asked ahead, not asked again
    assert asked == [0, 0, 1, 2]
    assert refresh.rollouts == 3 and refresh.version == 2


def test_the_seed_of_a_rollout_in_flight_is_handed_on_once_and_not_kept():
    """A checkpoint taken with a rollout in flight keeps that rollout's seed; the resumed run
    hands it to its engine once and drops it, so a later checkpoint of a run that samples nothing
    ahead (resumed with ``max_staleness`` 0) does not carry the old seed into every resume."""
    from types import SimpleNamespace

    refresh = OldPolicyRefresh()
    refresh.load_state_dict({"rollouts": 4, "refreshes": 4, "version": 4, "ahead_seed": 123})
    assert refresh.state_dict()["ahead_seed"] == 123  # kept until the resumed run starts
    module = SimpleNamespace(engine=SimpleNamespace(next_seed=None))
    refresh.on_train_start(None, module)
    assert module.engine.next_seed == 123
    assert "ahead_seed" not in refresh.state_dict()
    module.engine.next_seed = None
    refresh.on_train_start(None, module)  # a second start has nothing to hand on
    assert module.engine.next_seed is None


def test_an_engine_that_dies_while_asked_ahead_stops_the_run_as_a_fault():
    """The request for the next rollout, sent while this one is about to train, meets a dead
    engine: the run stops as at a death during sampling (EngineFault: a checkpoint, one line)."""
    from types import SimpleNamespace

    from lightning_troll.engines.process import EngineDied
    from lightning_troll.training.faults import EngineFault
    from lightning_troll.training.staleness import StalenessSchedule

    class Dead:
        policy_version = 0

        def submit(self, *args, **kwargs):
            raise EngineDied("the engine's process was killed by signal 9 (SIGKILL)")

    upcoming = SimpleNamespace(prompt_ids=[[1, 2]])
    module = SimpleNamespace(
        staleness=StalenessSchedule(max_staleness=1), engine=Dead(), episodes=None,
        dynamic_sampling=SimpleNamespace(enabled=False), policy=None, snapshot=None,
        collector=SimpleNamespace(group_size=2, sampling=None, pad_id=0, stop_ids=[3]),
    )  # fmt: skip
    trainer = SimpleNamespace(datamodule=SimpleNamespace(train_loader=SimpleNamespace(
        peek=lambda: upcoming)))  # fmt: skip
    with pytest.raises(EngineFault, match="killed by signal 9"):
        RolloutGeneration()._sample_ahead(trainer, module)


@pytest.mark.parametrize("fails", ["send", "recv"])
def test_a_connection_reset_by_the_dying_engine_is_its_death_not_a_traceback(fails):
    """The child killed between the liveness check and the pipe's use: the send meets a broken
    pipe, or the answer a reset connection (an OSError, not EOFError); either reads as the
    death, named by the signal, as an end of file does."""
    from lightning_troll.engines.process import EngineDied

    class Killed:
        exitcode = -9
        alive = True

        def is_alive(self):
            return self.alive

        def join(self, timeout=None):
            self.alive = False

    class Reset:
        def send(self, message):
            if fails == "send":
                raise BrokenPipeError(32, "Broken pipe")

        def recv(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    engine = ProcessEngine.__new__(ProcessEngine)
    engine.inner, engine._child, engine._conn = "hf", Killed(), Reset()
    with pytest.raises(EngineDied) as died:
        engine._send(("weights", {}))
        engine._receive("weights")
    assert str(died.value) == (
        "the 'hf' engine's process was killed by signal 9 (SIGKILL) while the rollout was sampled"
    )
