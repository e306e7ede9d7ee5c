"""PromptDataModule: sources, formatting, tokenization, shuffling, batching and validation."""

from __future__ import annotations

import json
import pickle
import string

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from lightning_troll.models.tinymath import char_tokenizer
from lightning_troll.tasks.data.datamodule import (
    EpochShuffleSampler,
    PromptBatch,
    PromptDataModule,
    PromptItem,
    collate_prompts,
    read_rows,
    write_jsonl,
)
from lightning_troll.tasks.rewards.registry import RewardScorer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII that prepends <bos> (id 1)."""
    return char_tokenizer("".join(sorted(set(string.printable) - set("\r\x0b\x0c"))), 512)


def rows_of(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(n)]


def make(tok, source, **options) -> PromptDataModule:
    dm = PromptDataModule(source=str(source), tokenizer=tok, **options)
    dm.setup("fit")
    return dm


def epoch_ids(dm: PromptDataModule, epoch: int = 0) -> list[list[int]]:
    """The row ids of every training batch of one epoch."""
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [[row["id"] for row in batch.rows] for batch in loader]


# ----------------------------------------------------------------------------- sources


def test_tinymath_source(tok):
    tinymath = pytest.importorskip("lightning_troll.models.tinymath")
    dm = make(tok, "tinymath", num_train=40, num_val=10, batch_size=8, seed=2)
    expected_train = tinymath.generate_problems(40, seed=2, split="train")
    assert sorted(item.text for item in dm.train_items) == sorted(
        r["prompt"] for r in expected_train
    )
    assert [item.row for item in dm.val_items] == tinymath.generate_problems(
        10, seed=2, split="test"
    )
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 8
    for text, ids, row in zip(batch.prompts, batch.prompt_ids, batch.rows, strict=True):
        assert text == row["prompt"] and ids == tok(text)["input_ids"] and ids[0] == 1
        assert int(row["answer"]) == eval(text[:-1])  # "23+58=" -> 81


def test_defaults_load_the_tinymath_tokenizer_by_name():
    pytest.importorskip("lightning_troll.models.tinymath")
    models = pytest.importorskip("lightning_troll.models.loading")
    dm = PromptDataModule(num_train=16, num_val=4)
    dm.setup("fit")
    expected = models.load_tokenizer("tinymath")
    assert [item.ids for item in dm.val_items] == [
        expected(i.text)["input_ids"] for i in dm.val_items
    ]
    assert len(next(iter(dm.train_dataloader()))) == 8


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_files_hold_out_validation_rows(tok, tmp_path, suffix):
    rows = rows_of(12)
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_rows(path) == rows
    dm = make(tok, path, num_val=3, batch_size=2, seed=5)
    train = [item.row["id"] for item in dm.train_items]
    val = [item.row["id"] for item in dm.val_items]
    assert len(val) == 3 and len(train) == 9
    assert sorted(train + val) == list(range(12))  # a partition of the file
    assert train == sorted(train) and val == sorted(val)  # both keep file order
    assert val == [item.row["id"] for item in make(tok, path, num_val=3, seed=5).val_items]
    assert val != [item.row["id"] for item in make(tok, path, num_val=3, seed=6).val_items]
    item = dm.train_items[0]
    assert item.text == f"{item.row['id']}+1=" and item.ids == tok(item.text)["input_ids"]


def test_json_lines_under_a_json_name_and_bad_files(tmp_path):
    lines = write_jsonl(tmp_path / "lines.json", rows_of(2))
    assert read_rows(lines) == rows_of(2)
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"prompt": ["a", "b"]}))
    with pytest.raises(ValueError, match="columns.json: expected a list of objects"):
        read_rows(columns)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not valid JSON"):
        read_rows(bad)


def test_val_file_caps_and_keeps_order(tok, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows_of(8))
    val = write_jsonl(tmp_path / "val.jsonl", rows_of(10))
    dm = make(tok, train, val_file=str(val), num_val=7, num_train=6, val_batch_size=3, batch_size=2)
    assert [item.row["id"] for item in dm.train_items] == list(range(6))  # first num_train rows
    batches = list(dm.val_dataloader())
    assert [len(b) for b in batches] == [3, 3, 1]  # no drop_last in validation
    assert [row["id"] for b in batches for row in b.rows] == list(range(7))  # in file order
    assert all(isinstance(b, PromptBatch) for b in batches)


def test_tinymath_with_a_val_file_takes_every_row_of_it_when_num_val_is_null(tmp_path):
    """The datamodule's docs: data.val_file works with any source, and num_val null takes all of
    its rows (TinyMath refused null before, as if the rows were its own)."""
    from lightning_troll.tasks.data.sources import PromptSource

    val = write_jsonl(tmp_path / "val.jsonl", rows_of(5))
    source = PromptSource("tinymath", None, "train", "test", 16, None, 0, str(val))
    assert [row["id"] for row in source.val_rows()] == list(range(5))
    with pytest.raises(ValueError, match="num_val must be an integer >= 0"):
        PromptSource("tinymath", None, "train", "test", 16, None, 0, None)


def test_num_val_zero_turns_validation_off(tok, tmp_path):
    dm = make(tok, write_jsonl(tmp_path / "d.jsonl", rows_of(4)), num_val=0, batch_size=2)
    assert dm.val_dataloader() == [] and len(dm.train_items) == 4


def test_hub_source_goes_through_load_dataset(tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(rows_of(20 if split == "train" else 6))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = PromptDataModule(
        "openai/gsm8k",
        dataset_config="main",
        tokenizer=tok,
        num_train=5,
        num_val=None,
        batch_size=2,
    )
    dm.prepare_data()
    dm.setup("fit")
    assert calls == [("openai/gsm8k", "main", s) for s in ("train", "test", "train", "test")]
    assert [item.row["id"] for item in dm.train_items] == list(range(5))
    assert [item.row["id"] for item in dm.val_items] == list(range(6))


# ----------------------------------------------------------------------------- formatting


GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = 24.\nIn all 48+24 = 72.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour. How much for 50 minutes?",
        "answer": "12/60*50 = 10\n#### 10",
    },
    {"question": "A book costs $1,200. Two cost?", "answer": "#### 2,400"},
]


def test_gsm8k_format_rows_with_the_gsm8k_reward(tok, tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    dm = make(
        tok,
        path,
        prompt_field="question",
        template="Question: {prompt}\nAnswer:",
        val_file=str(path),
        batch_size=3,
        max_prompt_tokens=128,
    )
    batch = next(iter(dm.val_dataloader()))
    assert batch.prompts[0] == f"Question: {GSM8K_ROWS[0]['question']}\nAnswer:"
    assert batch.prompt_ids[0] == tok(batch.prompts[0])["input_ids"]
    right = ["So 72 clips.\n#### 72", "He earns $10.\n#### 10", "#### 2400"]
    wrong = ["#### 73", "He earns $10.", "#### 1,200"]
    scorer = RewardScorer(["gsm8k"])
    assert scorer(batch.prompts, right, batch.rows).total.tolist() == [1.0, 1.0, 1.0]
    assert scorer(batch.prompts, wrong, batch.rows).total.tolist() == [0.0, 0.0, 0.0]


def test_template_may_use_any_field_and_answer_and_prompt_fields_are_renamed(tok, tmp_path):
    rows = [
        {"q": "2+2", "level": "easy", "solution": "4"},
        {"q": "9*9", "level": "hard", "solution": "81"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dm = make(
        tok,
        path,
        prompt_field="q",
        answer_field="solution",
        template="[{level}] {prompt} = ? ({q})",
        val_file=str(path),
        batch_size=2,
    )
    assert [item.text for item in dm.val_items] == ["[easy] 2+2 = ? (2+2)", "[hard] 9*9 = ? (9*9)"]
    # the gold answer under "answer", the unformatted prompt under "prompt"
    kept = [{**r, "answer": r["solution"], "prompt": r["q"]} for r in rows]
    assert [item.row for item in dm.val_items] == kept


def test_a_conversations_prompt_is_kept_under_prompt_and_a_rows_own_prompt_gives_way(tmp_path):
    """A ``messages`` row keeps the messages before its answer under "prompt" (what the built-in
    tool environment starts from); a row's own "prompt" field that is not ``data.prompt_field``
    gives way to the prompt, with a warning, so that an episode starts from what the option
    names, as a single completion does."""
    from tests.chat_helpers import chat_tokenizer

    talk = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": talk, "answer": "4"}] * 2)
    dm = make(chat_tokenizer(), path, val_file=str(path), batch_size=2)
    assert dm.val_items[0].row == {"messages": talk, "answer": "4", "prompt": talk[:2]}
    own = write_jsonl(tmp_path / "own.jsonl", [{"q": "2+2", "prompt": "mine", "answer": "4"}] * 2)
    with pytest.warns(UserWarning) as warned:
        dm = make(chat_tokenizer(), own, prompt_field="q", val_file=str(own), batch_size=2)
    assert dm.val_items[0].row == {"q": "2+2", "prompt": "2+2", "answer": "4"}
    assert [str(w.message) for w in warned if "'prompt'" in str(w.message)] == [
        "data.prompt_field='q': the rows also have a field 'prompt', which rewards and "
        "environments do not get: the rows they get hold the 'q' prompt under 'prompt' (an "
        "episode starts from it); rename the field to keep it"
    ]


def test_chat_template_with_system_prompt_and_a_single_bos(tok, tmp_path):
    chat_tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, **tok.special_tokens_map)
    chat_tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", rows_of(2))
    dm = make(
        chat_tok,
        path,
        chat_template=True,
        system_prompt="Be brief.",
        val_file=str(path),
        batch_size=2,
    )
    item = dm.val_items[0]
    assert item.text == "<bos>[system]Be brief.[user]0+1=[assistant]"
    assert item.ids == chat_tok(item.text, add_special_tokens=False)["input_ids"]
    assert item.ids.count(1) == 1 and item.ids[0] == 1  # the template's <bos>, not a second one
    with pytest.raises(
        ValueError,
        match="data.chat_template=true but the tokenizer .* has no chat template; "
        "set data.chat_template: null",
    ):
        make(tok, path, chat_template=True, val_file=str(path), batch_size=2)


# ----------------------------------------------------------------------------- batching


def test_shuffling_is_seeded_and_changes_each_epoch(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows_of(24))
    options = dict(val_file=str(path), batch_size=4)
    first = epoch_ids(make(tok, path, seed=1, **options))
    assert first == epoch_ids(make(tok, path, seed=1, **options))  # same seed, same order
    assert first != epoch_ids(make(tok, path, seed=2, **options))  # different seed
    assert first != epoch_ids(make(tok, path, seed=1, **options), epoch=1)  # next epoch reshuffles
    assert sorted(i for batch in first for i in batch) == list(range(24))
    assert first != [list(range(i, i + 4)) for i in range(0, 24, 4)]  # actually shuffled


def test_drop_last_keeps_only_full_batches(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows_of(10))
    ids = epoch_ids(make(tok, path, val_file=str(path), batch_size=4))
    assert [len(batch) for batch in ids] == [4, 4]
    assert len({i for batch in ids for i in batch}) == 8


def test_sampler_and_collate():
    sampler = EpochShuffleSampler(10, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(10)) and order == list(EpochShuffleSampler(10, seed=3))
    sampler.set_epoch(1)
    assert list(sampler) != order
    assert pickle.loads(pickle.dumps(collate_prompts)) is collate_prompts
    row = {"answer": "1"}
    batch = collate_prompts([PromptItem("a", [1, 2], row)])
    assert batch == PromptBatch(prompts=["a"], prompt_ids=[[1, 2]], rows=[{"answer": "1"}])
    assert batch.rows[0] is not row  # a reward function cannot change the dataset


@pytest.mark.parametrize("replicas", [2, 3])
def test_processes_share_each_global_batch_in_order(replicas):
    """Step k's batches of all processes, rank by rank, are step k's batch of one process with
    replicas x the batch size; the leftover that would make a partial global batch is dropped."""
    size, batch, seed = 29, 4, 5
    single = list(EpochShuffleSampler(size, seed))
    shares = [
        EpochShuffleSampler(size, seed, batch_size=batch, rank=r, replicas=replicas)
        for r in range(replicas)
    ]
    for sampler in shares:
        sampler.set_epoch(2)
    orders = [list(sampler) for sampler in shares]
    steps = size // (batch * replicas)
    assert all(
        len(order) == len(sampler) == steps * batch
        for order, sampler in zip(orders, shares, strict=True)
    )
    single_epoch2 = EpochShuffleSampler(size, seed)
    single_epoch2.set_epoch(2)
    expected = list(single_epoch2)
    for k in range(steps):
        joined = [i for order in orders for i in order[k * batch : (k + 1) * batch]]
        assert joined == expected[k * batch * replicas : (k + 1) * batch * replicas]
    assert expected != single  # the epoch matters


def test_sampler_rejects_a_bad_share():
    with pytest.raises(ValueError, match=r"rank=2, replicas=2"):
        EpochShuffleSampler(10, 0, batch_size=2, rank=2, replicas=2)


def test_state_dict_round_trip(tok, tmp_path):
    dm = make(tok, write_jsonl(tmp_path / "d.jsonl", rows_of(6)), num_val=2, seed=4, batch_size=2)
    assert dm.state_dict() == {"seed": 4}
    dm.load_state_dict({"seed": 4})
    with pytest.warns(UserWarning, match="data.seed=4 differs from the checkpoint's 5"):
        dm.load_state_dict({"seed": 5})


def test_trainer_reshuffles_each_epoch_and_validates(tok, tmp_path):
    """A real Trainer: Lightning calls set_epoch, moves PromptBatch intact, runs validation."""
    from lightning.pytorch import LightningModule, Trainer

    class Recorder(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.train_ids: list[list[int]] = []
            self.val_ids: list[int] = []

        def training_step(self, batch, batch_idx):
            assert isinstance(batch, PromptBatch)
            self.train_ids.append([row["id"] for row in batch.rows])
            return self.layer(torch.ones(1)).sum()

        def validation_step(self, batch, batch_idx):
            self.val_ids.extend(row["id"] for row in batch.rows)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    path = write_jsonl(tmp_path / "d.jsonl", rows_of(10))
    dm = PromptDataModule(str(path), tokenizer=tok, num_val=2, batch_size=4, seed=7)
    model = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    assert model.train_ids[:2] == epoch_ids(dm, epoch=0)
    assert model.train_ids[2:] == epoch_ids(dm, epoch=1)
    assert model.train_ids[:2] != model.train_ids[2:]
    assert model.val_ids == [item.row["id"] for item in dm.val_items] * 2  # once per epoch


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            dict(source="missing.jsonl"),
            r"data.source: file 'missing.jsonl' does not exist; give a \.json, \.jsonl or \.parquet file, the built-in 'tinymath', or a hub dataset name",
        ),
        (dict(source="./data/train"), "data.source: file './data/train' does not exist"),
        (dict(val_file="nope.json"), "data.val_file: file 'nope.json' does not exist"),
        (dict(batch_size=0), "data.batch_size must be an integer >= 1; got 0"),
        (dict(val_batch_size=-1), "data.val_batch_size must be an integer >= 1; got -1"),
        (dict(max_prompt_tokens=0), "data.max_prompt_tokens must be an integer >= 1; got 0"),
        (dict(num_train=None), "data.num_train must be an integer >= 1; got None"),
        (dict(seed=-1), "data.seed must be an integer >= 0; got -1"),
        (
            dict(system_prompt="Hi", chat_template=False),
            "data.system_prompt='Hi' needs the chat template, but data.chat_template=false",
        ),
        (dict(template="{prompt"), "data.template='{prompt' is not a valid format string"),
        (dict(template="{0}"), r"data.template='\{0\}' has a positional field"),
    ],
)
def test_init_validation(tok, options, match):
    with pytest.raises(ValueError, match=match):
        PromptDataModule(**{"tokenizer": tok, **options})


def test_unreadable_file_type(tok, tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"data.source: cannot read '.csv' files"):
        PromptDataModule(str(path), tokenizer=tok)


def test_local_file_holdout_needs_a_number(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows_of(4))
    with pytest.raises(ValueError, match="data.num_val must be an integer >= 0; got None"):
        PromptDataModule(str(path), tokenizer=tok, num_val=None)
    with pytest.raises(ValueError, match="data.num_val=4 would hold out every row"):
        make(tok, path, num_val=4)


def test_missing_field(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    match = r"data.prompt_field='prompt' needs the field 'prompt', which is not a field of the train rows of '.*d.jsonl'; fields are \['answer', 'question'\]"
    with pytest.raises(ValueError, match=match):
        make(tok, path, num_val=1, batch_size=1)
    with pytest.raises(ValueError, match="data.answer_field='solution' needs the field 'solution'"):
        make(tok, path, num_val=1, batch_size=1, prompt_field="question", answer_field="solution")
    with pytest.raises(
        ValueError, match=r"data.template='{prompt} \({level}\)' needs the field 'level'"
    ):
        make(
            tok,
            path,
            num_val=1,
            batch_size=1,
            prompt_field="question",
            template="{prompt} ({level})",
        )
    rows = [*rows_of(2), {"answer": "3"}]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(
        ValueError,
        match="data.prompt_field='prompt': line 3 of the train rows .* has no field 'prompt'",
    ):
        make(tok, path, val_file=str(path), batch_size=1)


def test_prompt_too_long(tok, tmp_path):
    rows = [*rows_of(3), {"prompt": "x" * 20, "answer": "1", "id": 3}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    # "x" * 20 is 21 tokens with <bos>; "0+1=" is 5.
    with pytest.raises(
        ValueError,
        match=r"data.max_prompt_tokens=8: 1 of 4 train prompts .* line 4 with 21 tokens",
    ):
        make(tok, path, val_file=str(path), max_prompt_tokens=8, batch_size=1)
    assert (
        len(make(tok, path, val_file=str(path), max_prompt_tokens=21, batch_size=1).val_items) == 4
    )


@pytest.mark.parametrize("split", ["train", "validation"])
def test_errors_name_the_files_own_row_where_rows_were_held_out(tok, tmp_path, split):
    """Rows held out for validation leave the training rows a part of the file (and the held-out
    rows another): an error names the bad row's line in the file, the line the user finds."""
    probe = make(tok, write_jsonl(tmp_path / "probe.jsonl", rows_of(10)), num_val=3, batch_size=1)
    ids = {"train": [r.row["id"] for r in probe.train_items],
           "validation": [r.row["id"] for r in probe.val_items]}[split]  # fmt: skip
    bad = ids[-1]
    assert bad != len(ids) - 1, "the row must sit elsewhere in the file than in its split"
    rows = rows_of(10)
    rows[bad] = {"prompt": 12, "answer": "1", "id": bad}
    where = "train rows" if split == "train" else "validation rows"
    with pytest.raises(
        ValueError, match=rf"line {bad + 1} of the {where} of .* holds a int \(12\)"
    ):
        make(tok, write_jsonl(tmp_path / "bad.jsonl", rows), num_val=3, batch_size=1)


def test_batch_size_larger_than_the_data(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows_of(5))
    with pytest.raises(ValueError, match="data.batch_size=8 is larger than the 4 training rows"):
        make(tok, path, num_val=1, batch_size=8)


def test_prompt_must_be_text(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 12, "answer": "1"}])
    with pytest.raises(
        ValueError,
        match=r"data.prompt_field='prompt': line 1 of the train rows of .* holds a int \(12\), not text",
    ):
        make(tok, path, val_file=str(path), batch_size=1)


def test_several_processes_need_a_batch_each_before_training_starts(tok, tmp_path):
    """Two processes with 8 prompts each need 16 rows: 10 are refused at setup (before, each
    process's loader had no batch, and the run ended at once saying that training finished)."""
    from types import SimpleNamespace

    source = write_jsonl(tmp_path / "d.jsonl", rows_of(10))
    dm = PromptDataModule(source=str(source), tokenizer=tok, batch_size=8, num_val=0)
    dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    with pytest.raises(
        ValueError, match=r"data.batch_size=8 x 2 processes is larger than the 10 training rows"
    ):
        dm.setup("fit")
    dm = PromptDataModule(source=str(source), tokenizer=tok, batch_size=5, num_val=0)
    dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 1
