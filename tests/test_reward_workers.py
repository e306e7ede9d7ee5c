"""Robust rewards: math_verify against boxed and last_number, failure policies, reward worker
processes with timeouts and deaths, and a reward model as a reward."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from lightning_troll.tasks.rewards import workers as workers_module
from lightning_troll.tasks.rewards.registry import (
    RewardError,
    RewardScorer,
    RewardWarning,
    boxed,
    last_number,
)

H = "tests.reward_helpers:"


# ----------------------------------------------------------------------------- math_verify

# (completion, gold): boxed or last_number score 0.0 on each, math_verify 1.0
MATH_VERIFY_RIGHT = [
    ("so the answer is \\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),  # equivalent fractions
    ("\\boxed{0.5}", "\\frac{1}{2}"),  # \frac against a decimal
    ("The roots are \\boxed{\\{3, -1\\}}.", "\\{-1, 3\\}"),  # a LaTeX set, in another order
    ("We get \\boxed{\\frac{3}{4}} after simplifying, checked twice.", "3/4"),  # box in text
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),  # equal radicals
]


@pytest.mark.parametrize(("completion", "gold"), MATH_VERIFY_RIGHT)
def test_math_verify_is_right_where_boxed_or_last_number_are_wrong(completion, gold):
    pytest.importorskip("math_verify")
    from lightning_troll.tasks.rewards.functions import math_verify

    row = {"answer": gold}
    assert math_verify("Q?", completion, row) == 1.0
    assert min(boxed("Q?", completion, row), last_number_or_zero(completion, row)) == 0.0


def last_number_or_zero(completion, row) -> float:
    try:
        return last_number("Q?", completion, row)
    except ValueError:  # a gold answer without a plain number
        return 0.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [("\\boxed{\\frac{1}{3}}", "0.5"), ("\\boxed{\\{1, 2\\}}", "\\{1, 3\\}"), ("no answer", "7")],
)
def test_math_verify_scores_wrong_answers_zero(completion, gold):
    pytest.importorskip("math_verify")
    from lightning_troll.tasks.rewards.functions import math_verify

    assert math_verify("Q?", completion, {"answer": gold}) == 0.0


def test_math_verify_by_name_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'lightning-troll\[math\]'") as info:
        RewardScorer({"math_verify": 1.0})
    assert "\n" not in str(info.value)


def test_every_builtin_says_when_to_use_it():
    from lightning_troll.tasks.rewards.registry import REWARD_FUNCTIONS

    for name in ("tinymath", "gsm8k", "boxed", "last_number", "overlong", "math_verify"):
        assert "Use it" in REWARD_FUNCTIONS[name].__doc__, name


# ----------------------------------------------------------------------------- failure policies


def test_a_number_policy_scores_failed_calls_and_counts_them():
    """bad_values on ["ok", "nan", "raise", "none"] with on_error=-1: scores 1, -1, -1, -1; all
    four samples stay valid; three errors, no timeout; one warning naming the first failures."""
    scorer = RewardScorer({H + "bad_values": 2.0}, on_error=-1.0)
    with pytest.warns(RewardWarning, match=r"3 reward calls on 4 samples failed") as record:
        out = scorer(["p"] * 4, ["ok", "nan", "raise", "none"], [{}] * 4)
    assert len(record) == 1
    message = str(record[0].message)
    assert "on sample 1 returned nan" in message and "RuntimeError: broken verifier" in message
    assert out.valid.all()
    assert out.per_function[H + "bad_values"].tolist() == [1.0, -1.0, -1.0, -1.0]
    assert out.total.tolist() == [2.0, -2.0, -2.0, -2.0]
    assert out.errors == {H + "bad_values": 3} and out.timeouts == {H + "bad_values": 0}


def test_each_function_keeps_its_own_policy():
    scorer = RewardScorer(
        {H + "bad_values": 1.0, H + "none_for_even_lengths": 1.0},
        on_error={H + "bad_values": 0.0, H + "none_for_even_lengths": "drop"},
    )
    with pytest.warns(RewardWarning, match="dropped 1 of 2"):
        out = scorer(["p", "p"], ["nan", "ok"], [{}, {}])
    # "nan": bad_values fails and scores 0.0, length 3 is odd: 1.0; "ok": length 2 is even:
    # none_for_even_lengths fails and drops the sample
    assert out.valid.tolist() == [True, False]
    assert out.total.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"reward_options.on_error names \['nope'\]"):
        RewardScorer({"gsm8k": 1.0}, on_error={"nope": "drop"})
    with pytest.raises(ValueError, match="must be 'raise', 'drop' or a finite number"):
        RewardScorer({"gsm8k": 1.0}, on_error={"gsm8k": float("nan")})


def test_a_batched_function_of_the_wrong_length_fails_every_sample():
    def two_scores(prompts, completions, rows):
        return [1.0, 1.0]

    two_scores.batched = True
    scorer = RewardScorer([two_scores], on_error="drop")
    with pytest.warns(RewardWarning, match="one score per completion"):
        out = scorer(["p"] * 3, ["a", "b", "c"], [{}] * 3)
    assert out.valid.tolist() == [False] * 3
    assert out.errors == {"two_scores": 3}


# ----------------------------------------------------------------------------- workers


def test_timeouts_need_workers_and_workers_need_picklable_functions():
    with pytest.raises(
        ValueError,
        match="^model.reward_options.timeout=2.0 needs model.reward_options.workers >= 1",
    ):
        RewardScorer({"gsm8k": 1.0}, timeout=2.0)
    with pytest.raises(ValueError, match="cannot run in a worker process"):
        RewardScorer([lambda p, c, r: 1.0], workers=1)
    with pytest.raises(
        ValueError, match=r"^model.reward_options.workers must be an integer >= 0 \(0: no worker"
    ):
        RewardScorer({"gsm8k": 1.0}, workers=-1)
    for timeout in (0, math.inf, "5"):
        with pytest.raises(
            ValueError,
            match=r"^model.reward_options.timeout must be null \(no limit\) or a finite number > 0 "
            rf"of seconds; got {timeout!r}$",
        ):
            RewardScorer({"gsm8k": 1.0}, workers=1, timeout=timeout)


@pytest.mark.slow
def test_workers_score_as_the_trainer_does_and_in_parallel():
    completions = ["#### 3", "#### 4", "x", "#### 3"]
    rows = [{"answer": "3"}] * 4
    here = RewardScorer({"gsm8k": 1.0, H + "length_reward": 0.5})(["p"] * 4, completions, rows)
    scorer = RewardScorer({"gsm8k": 1.0, H + "length_reward": 0.5}, workers=2)
    try:
        there = scorer(["p"] * 4, completions, rows)
        assert torch.equal(here.total, there.total) and torch.equal(here.valid, there.valid)
        pids = RewardScorer([H + "process_id", H + "slow_half"], workers=2)
        try:
            seen = set(pids(["p"] * 8, ["c"] * 8, [{}] * 8).per_function[H + "process_id"].tolist())
        finally:
            pids.close()
        assert len(seen) == 2 and float(os.getpid()) not in seen  # both workers, not this one
    finally:
        scorer.close()


def test_an_async_reward_is_awaited_in_a_worker_as_here():
    """``async def`` rewards score in the workers as in the trainer's process: lengths 2 and 5."""
    scorer = RewardScorer([H + "awaited_length"], workers=1)
    try:
        there = scorer(["p", "q"], ["ab", "abcde"], [{}, {}]).total.tolist()
    finally:
        scorer.close()
    assert there == [2.0, 5.0]
    assert RewardScorer([H + "awaited_length"])(["p"], ["abc"], [{}]).total.tolist() == [3.0]


@pytest.mark.slow
def test_a_call_past_its_timeout_is_abandoned_and_its_worker_replaced():
    """["ok", "hang", "ok", "hang"], 2 workers, a 1 s timeout, failures scored 0: both hangs
    time out (2 timeouts), the run goes on, and the next call finds working workers."""
    scorer = RewardScorer({H + "hangs_on_hang": 1.0}, on_error=0.0, workers=2, timeout=1.0)
    try:
        with pytest.warns(RewardWarning, match=r"timed out after 1 s.*'hang'"):
            out = scorer(["p"] * 4, ["ok", "hang", "ok", "hang"], [{}] * 4)
        assert out.total.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert out.timeouts == {H + "hangs_on_hang": 2} and out.errors == {H + "hangs_on_hang": 0}
        assert scorer.workers.restarts == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert scorer(["p"] * 2, ["ok", "ok"], [{}] * 2).total.tolist() == [1.0, 1.0]
    finally:
        scorer.close()


@pytest.mark.slow
@pytest.mark.parametrize("death", ["die", "kill"])
def test_a_worker_that_dies_is_restarted_and_the_trainer_goes_on(death):
    scorer = RewardScorer({H + "dies_on_die": 1.0}, on_error="drop", workers=2)
    try:
        with pytest.warns(RewardWarning, match="killed its worker process"):
            out = scorer(["p"] * 3, ["ok", death, "ok"], [{}] * 3)
        assert out.valid.tolist() == [True, False, True]
        assert out.errors == {H + "dies_on_die": 1}
        assert scorer(["p"], ["ok"], [{}]).total.tolist() == [1.0]
    finally:
        scorer.close()


def test_a_worker_leaves_ctrl_c_and_sigterm_to_the_trainer():
    """The stop signals reach every process of a job; the trainer answers the first by finishing
    its rollout and saving, so a worker must live on and score that rollout (before, a Ctrl-C
    failed the call as "killed its worker process" and ended the run as a reward fault)."""
    scorer = RewardScorer({H + "signals_itself": 1.0}, workers=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no call fails, none is dropped
            out = scorer(["p"] * 3, ["a", "b", "c"], [{}] * 3)
        assert out.total.tolist() == [1.0, 1.0, 1.0] and out.valid.all()
        assert sum(out.errors.values()) == 0
    finally:
        scorer.close()


@pytest.mark.slow
def test_the_workers_server_outlives_a_stop_signal_and_every_call_is_answered():
    """A scheduler's SIGTERM reaches every process of the job, the workers' server among them. Had
    it ended, every worker, alive, would read as dead (exit code 255) and fail its call in the
    rollout the trainer finishes before it saves. The server ignores the signal: it lives on,
    and the calls after it (one timing out, its worker forked anew) are all answered."""
    from multiprocessing import forkserver

    scorer = RewardScorer({H + "hangs_on_hang": 1.0}, on_error=0.0, workers=2, timeout=1.0)
    ours = signal.getsignal(signal.SIGTERM)
    try:
        assert scorer(["p"] * 2, ["ok"] * 2, [{}] * 2).total.tolist() == [1.0, 1.0]
        # only the server ignores it: the trainer's own answer to SIGTERM stands
        assert workers_module.SERVER_START not in sys.modules
        assert signal.getsignal(signal.SIGTERM) == ours
        server = forkserver._forkserver._forkserver_pid
        os.kill(server, signal.SIGTERM)
        time.sleep(1.0)
        assert Path(f"/proc/{server}/stat").read_text().split()[2] != "Z", "the server ended"
        with pytest.warns(RewardWarning, match="timed out after 1 s") as caught:
            out = scorer(["p"] * 4, ["ok", "hang", "ok", "ok"], [{}] * 4)
        assert out.total.tolist() == [1.0, 0.0, 1.0, 1.0], [str(w.message) for w in caught]
        assert out.timeouts == {H + "hangs_on_hang": 1} and out.errors == {H + "hangs_on_hang": 0}
        assert scorer.workers.restarts == 1
        assert forkserver._forkserver._forkserver_pid == server
    finally:
        scorer.close()


@pytest.mark.slow
def test_raise_policy_in_workers_names_the_timeout():
    scorer = RewardScorer({H + "hangs_on_hang": 1.0}, workers=1, timeout=0.5)
    try:
        with pytest.raises(RewardError, match=r"on sample 1 .* timed out after 0.5 s"):
            scorer(["p"] * 2, ["ok", "hang"], [{}] * 2)
    finally:
        scorer.close()


@pytest.mark.slow
def test_raise_policy_in_workers_stops_at_the_first_failure(tmp_path):
    """One worker, a 0.5 s timeout, the first of six completions hangs: the scoring stops when it
    times out and raises naming it; none of the other five calls ever started."""
    scorer = RewardScorer({H + "hangs_and_counts": 1.0}, workers=1, timeout=0.5)
    completions = ["hang", "a", "b", "c", "d", "e"]
    try:
        with pytest.raises(RewardError, match=r"on sample 0 .* timed out after 0.5 s"):
            scorer(["p"] * 6, completions, [{"calls": str(tmp_path)}] * 6)
    finally:
        scorer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["hang"]


# ----------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A randomly initialised 2-layer LlamaForSequenceClassification (one label) with the
    TinyMath tokenizer, saved like a hub model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lightning_troll.models.tinymath import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("tiny_reward_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval(), tokenizer


def test_a_reward_model_scores_in_batches_as_one_at_a_time(tiny_classifier):
    """The scorer's batched scores (batch size 2, padding on the right) equal the classifier's
    logit on each text alone, to float32 rounding."""
    path, model, tokenizer = tiny_classifier
    scorer = RewardScorer(
        {f"reward_model:{path}": 1.0}, kwargs={f"reward_model:{path}": {"batch_size": 2}}
    )
    prompts = ["3+4=", "12+5=", "1+1="]
    completions = ["7", "17 because 12 + 5 = 17", "2"]
    out = scorer(prompts, completions, [{}] * 3, device="cpu")
    fn = scorer.functions[f"reward_model:{path}"]
    with torch.no_grad():
        alone = [
            model(**tokenizer(fn.text(p, c, {}), return_tensors="pt")).logits[0, 0].item()
            for p, c in zip(prompts, completions, strict=True)
        ]
    torch.testing.assert_close(out.total, torch.tensor(alone), rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in fn._model.parameters())
    assert scorer.full_marks == 0.0  # a reward model has no best score


def test_a_reward_model_named_by_path_and_checked(tiny_classifier):
    path = tiny_classifier[0]
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        RewardScorer(
            {f"reward_model:{path}": 1.0}, kwargs={f"reward_model:{path}": {"batch_size": 0}}
        )


@pytest.mark.slow
def test_a_worker_killed_while_idle_is_replaced_before_the_next_call():
    scorer = RewardScorer({H + "length_reward": 1.0}, workers=2)
    try:
        assert scorer(["p"], ["abc"], [{}]).total.tolist() == [3.0]
        for worker in scorer.workers._workers:  # the OOM killer, between two rollouts
            worker.process.kill()
            worker.process.join()
        out = scorer(["p"] * 3, ["a", "ab", "abc"], [{}] * 3)
        assert out.total.tolist() == [1.0, 2.0, 3.0] and out.errors == {H + "length_reward": 0}
        assert scorer.workers.restarts == 2
    finally:
        scorer.close()


def _never_ready(conn, alive) -> None:  # pragma: no cover - a worker process
    """A worker that never says it is ready (until it is killed)."""
    time.sleep(120)


def test_a_worker_killed_while_starting_is_replaced(monkeypatch):
    """The OOM killer may take a worker before it has said it is ready: the pool starts another.
    The worker killed here never says it is ready, so the kill comes while it starts however
    loaded the machine is (a real worker may say it before the kill lands)."""
    scorer = RewardScorer({H + "length_reward": 1.0}, workers=1)
    pool = scorer.workers
    try:
        with monkeypatch.context() as patch:
            patch.setattr(workers_module, "_serve", _never_ready)
            pool._workers.append(workers_module._Worker(pool._context()))
        pool._workers[0].process.kill()
        out = scorer(["p"] * 2, ["a", "ab"], [{}] * 2)
        assert out.total.tolist() == [1.0, 2.0] and pool.restarts == 1
    finally:
        scorer.close()


@pytest.mark.parametrize("on_error", ["raise", "drop", 0.0])
def test_a_reward_a_worker_cannot_load_stops_the_run_whatever_on_error_says(monkeypatch, on_error):
    """No call of it can run in the workers: not one completion's failure to drop or score."""
    import pickle

    from lightning_troll.tasks.rewards import registry
    from tests.tool_helpers import LoadsNowhere

    monkeypatch.setattr(registry, "check_picklable", lambda *a: pickle.dumps(LoadsNowhere()))
    scorer = RewardScorer({H + "length_reward": 1.0}, workers=1, on_error=on_error)
    try:
        with pytest.raises(RewardError, match=r"^reward function 'tests.reward_helpers:length_reward' "
                           r"cannot be loaded in a worker: ImportError: No module named 'gone'; "
                           r"model.reward_options.workers 0"):  # fmt: skip
            scorer(["p"], ["a"], [{}])
    finally:
        scorer.close()


@pytest.mark.usefixtures("workers_die_at_start")
def test_workers_that_cannot_start_are_named_after_three_tries():
    scorer = RewardScorer({H + "length_reward": 1.0}, workers=1)
    try:
        with pytest.raises(RewardError, match=r"^3 reward worker processes in a row exited while "
                           r"starting \(the last with exit code -9\); run with "
                           r"model.reward_options.workers 0"):  # fmt: skip
            scorer(["p"], ["a"], [{}])
    finally:
        scorer.close()


@pytest.mark.slow
def test_the_worker_benchmark_prints_both_figures(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "benchmark_reward_workers.py"
    out = tmp_path / "figures.json"
    args = ["--completions", "4", "--delay", "0.01", "--workers", "2", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "serial" in done.stdout and "2 workers" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["completions"] == 4 and figures["serial_s"] > 0 and figures["workers_s"] > 0


@pytest.mark.slow
def test_math_verify_trains_by_name(tmp_path, tiny_model_dir):
    """A fit with ``rewards: {math_verify: 1.0}``: the name resolves, every completion is scored
    against the TinyMath answers, and the optimiser steps run."""
    pytest.importorskip("math_verify")
    import torch

    from tests.test_training import fit, make_module

    module = make_module(tiny_model_dir, rewards={"math_verify": 1.0})
    trainer, module, recorder = fit(tmp_path, tiny_model_dir, max_steps=2, module=module)
    assert trainer.global_step == 2
    from lightning_troll.tasks.rewards.functions import math_verify

    assert module.scorer.functions == {"math_verify": math_verify}
    reward = trainer.callback_metrics["reward/mean"]
    assert torch.isfinite(reward) and 0.0 <= float(reward) <= 1.0
    assert recorder.rollouts[0].rewards.shape == (16,)


def _descendants(pid: int) -> set[int]:
    """The live processes below ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # a zombie has exited
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


TRAINER = """
import sys
sys.path.insert(0, {root!r})
from lightning_troll.tasks.rewards.registry import RewardScorer
if __name__ == "__main__":
    scorer = RewardScorer({{"tests.reward_helpers:hangs_and_counts": 1.0}}, workers=2,
                          on_error="drop")
    scorer(["p"] * 2, ["hang", "hang"], [{{"calls": {calls!r}}}] * 2)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_workers_die_with_a_trainer_killed_with_sigkill(tmp_path):
    """A trainer whose two workers hang in their reward calls is killed with SIGKILL: within 10 s
    nothing it started lives on (workers, their forkserver, the resource tracker)."""
    calls = tmp_path / "calls"
    calls.mkdir()
    script = tmp_path / "trainer.py"
    root = str(Path(__file__).resolve().parents[1])
    script.write_text(TRAINER.format(root=root, calls=str(calls)))
    trainer = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(calls.iterdir())) < 1:  # both calls write the same name: "hang"
            assert trainer.poll() is None, trainer.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the workers did not start in 2 minutes"
            time.sleep(0.1)
        time.sleep(1.0)  # both workers busy
        started = _descendants(trainer.pid)
        assert len(started) >= 4  # two workers, their server, the resource tracker
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while alive := {p for p in started if Path(f"/proc/{p}").exists() and p in _all_live()}:
        if time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{len(alive)} processes outlived their trainer: {sorted(alive)}")
        time.sleep(0.2)


def _all_live() -> set[int]:
    live = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                live.add(int(stat.parent.name))
        except OSError:
            continue
    return live
