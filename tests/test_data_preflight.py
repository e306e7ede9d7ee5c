"""Data mistakes found before anything loads, each named by option, file and line; repeated and
leaked prompts warned about; a refused start leaves no run folder and loads no model."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lightning_troll.tasks.data.preflight import check_data_files
from tests.conftest import refused_here

ROOT = Path(__file__).resolve().parents[1]
GOOD = b'{"question": "What is 1 + 1?", "answer": 2}\n'


@pytest.mark.parametrize(
    "name, content, options, message",
    [
        ("bytes.jsonl", GOOD * 3 + b'{"question": "caf\xe9", "answer": 1}\n', {},
         "data.source='{path}', line 4, column 18: not UTF-8 text (byte 0xe9)"),
        ("missing.jsonl", GOOD * 29 + b'{"q": "x", "answer": 3}\n', {},
         "data.source='{path}', line 30: the row has no field 'question', which "
         "data.prompt_field='question' needs; its fields are ['answer', 'q']"),
        ("blank_lines.jsonl", b"\n" + GOOD + b"\n\n" + b'{"question": "x"}\n', {},
         "line 5: the row has no field 'answer', which data.answer_field='answer' needs"),
        ("template.jsonl", GOOD + b'{"question": "x", "answer": 1}\n', {"template": "{question} {unit}"},
         "line 1: the row has no field 'unit', which data.template='{{question}} {{unit}}' needs"),
        ("empty.jsonl", b"", {}, "data.source='{path}' holds no rows (an empty file)"),
        ("spaces.jsonl", b"\n  \n", {}, "holds no rows"),
        ("not_json.jsonl", GOOD + b"{question: 1}\n", {}, "line 2: not valid JSON"),
        ("a_list.jsonl", GOOD + b"[1, 2]\n", {}, "line 2: expected an object"),
    ],
)  # fmt: skip
def test_a_bad_data_file_is_named_by_option_file_and_line(
    tmp_path, name, content, options, message
):
    path = tmp_path / name
    path.write_bytes(content)
    data = {"source": str(path), "prompt_field": "question", "answer_field": "answer", **options}
    with pytest.raises(ValueError) as refused:
        check_data_files(data)
    assert message.format(path=path) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_file_too_small_for_its_held_out_rows_is_refused_before_anything_loads(tmp_path):
    """``data.num_val`` (200 by default) held out of a 3-row file leaves no training row: refused
    by the file check, as the data module would refuse it after the model loads; with
    ``data.val_file`` nothing is held out of the file, and with fewer held out it is accepted."""
    path = tmp_path / "small.jsonl"
    path.write_bytes(GOOD * 3)
    data = {"source": str(path), "prompt_field": "question"}
    with pytest.raises(ValueError, match=r"^data.num_val=200 would hold out every row of .*3 rows"):
        check_data_files({**data, "num_val": 200})
    check_data_files({**data, "num_val": 2})
    check_data_files({**data, "num_val": 200, "val_file": str(path)})


def test_a_folder_and_a_missing_validation_file_are_named(tmp_path):
    folder = tmp_path / "x.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"data.source: '.*x.jsonl' is a folder, not a file"):
        check_data_files({"source": str(folder)})
    good = tmp_path / "good.jsonl"
    good.write_bytes(GOOD)
    gone = str(tmp_path / "gone.jsonl")
    with pytest.raises(ValueError, match=r"data.val_file: file '.*gone.jsonl' does not exist"):
        check_data_files({"source": str(good), "prompt_field": "question", "val_file": gone})


def test_repeated_prompts_and_validation_prompts_seen_in_training_are_warned_about(tmp_path):
    """Training rows: 'a', 'b', 'a' (line 3 repeats line 1); validation rows 'b' and 'c': one
    of the two is a training prompt (line 1 there, line 2 of the training file)."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "a"}\n')
    val.write_text('{"prompt": "b"}\n{"prompt": "c"}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_data_files({"source": str(train), "val_file": str(val)})
    said = [str(w.message) for w in caught]
    assert len(said) == 2, said
    assert "1 of 3 rows repeat an earlier row's prompt (first: line 3 repeats line 1)" in said[0]
    assert "held out of the same file" not in said[0]  # validation comes from its own file
    assert "1 of the 2 prompts of data.val_file" in said[1]
    assert "(first: line 1 there, line 2 here)" in said[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_data_files({"source": str(train), "num_val": 1})
    assert "held out of the same file a prompt can be in both" in str(caught[0].message)


def test_tinymath_and_hub_sources_are_left_to_their_loaders():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_data_files({"source": "tinymath"})
        check_data_files({"source": "openai/gsm8k"})


@pytest.mark.slow
def test_a_refused_data_file_leaves_no_run_folder_and_loads_no_model(tmp_path, monkeypatch, capsys):
    """Through the command's main, here: a row without its field is refused with exit status 2
    and one error line naming the line; the model folder (empty) is never read, no run folder is
    written."""
    data = tmp_path / "rows.jsonl"
    data.write_bytes(GOOD * 3 + b'{"question": "x"}\n')
    empty = tmp_path / "no_model_here"
    empty.mkdir()
    command = [
        "fit",
        "--config", str(ROOT / "configs" / "tinymath.yaml"),
        "--model.model", str(empty), "--model.rewards", '{"last_number": 1.0}',
        "--data.source", str(data), "--data.prompt_field", "question",
        "--data.answer_field", "answer", "--data.num_val", "1",
    ]  # fmt: skip
    stderr = refused_here(command, tmp_path, monkeypatch, capsys)
    errors = [
        line
        for line in stderr.splitlines()
        if line.startswith("lightning-troll:") and "lightning-troll: warning:" not in line
    ]
    assert (
        len(errors) == 1
        and f"data.source='{data}', line 4: the row has no field 'answer'" in errors[0]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_model_here", "rows.jsonl"]


def test_an_unreachable_hub_id_is_refused_at_once(monkeypatch, tmp_path, tiny_model_dir):
    """A hub id that is not cached, with the hub's host not answering (or HF_HUB_OFFLINE set):
    one line naming the option and why, before any download is tried. Local folders and the
    shipped TinyMath pass without touching the network."""
    import socket

    from huggingface_hub import constants

    from lightning_troll.models.loading import check_reachable

    tried = []

    def no_network(address, timeout=None):
        tried.append(address)
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(
        ValueError,
        match=r"model.model='someorg/nomodel' is neither a local folder nor in the Hugging Face cache, and https?://\S+ cannot be reached \(OSError: Network is unreachable\)",
    ):
        check_reachable("someorg/nomodel")
    assert len(tried) == 1
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="and HF_HUB_OFFLINE is set"):
        check_reachable("someorg/nomodel")
    check_reachable(str(tiny_model_dir))
    check_reachable("tinymath")
    assert len(tried) == 1


def test_a_hub_dataset_name_is_checked_before_the_model_loads(monkeypatch, tmp_path):
    """A hub dataset that is not cached: refused where the hub is off or out of reach, and where
    the hub answers that it has no dataset of that name (a misspelt one); passed where it has
    one, or where the cache holds it, without asking. Files and TinyMath never ask."""
    import datasets.config
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from lightning_troll.models import loading
    from lightning_troll.tasks.data.preflight import check_hub_dataset

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    reach: list[str | None] = ["https://hub.example cannot be reached (OSError: down)"]
    monkeypatch.setattr(loading, "hub_unreachable", lambda timeout: reach[0])
    asked: list[str] = []

    def dataset_info(self, name, timeout=None):
        asked.append(name)
        if name != "openai/gsm8k":
            missing = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
            Exception.__init__(missing, "404")
            raise missing

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    with pytest.raises(
        ValueError,
        match=r"^data.source='openai/gsm8k' is neither a local file nor a hub dataset in the "
        r"Hugging Face cache, and https://hub.example cannot be reached \(OSError: down\); give "
        r"a .json, .jsonl or .parquet file",
    ):
        check_hub_dataset("openai/gsm8k")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    with pytest.raises(ValueError, match=r"and HF_DATASETS_OFFLINE is set;"):
        check_hub_dataset("openai/gsm8k")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    reach[0] = None  # the hub answers
    with pytest.raises(ValueError, match=r"'opnai/gsm8k' .* the hub has no dataset of that name"):
        check_hub_dataset("opnai/gsm8k")
    check_hub_dataset("openai/gsm8k")
    assert asked == ["opnai/gsm8k", "openai/gsm8k"]
    reach[0] = "HF_HUB_OFFLINE is set"  # cached (by the hub's files or datasets' own): no question
    (tmp_path / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    check_hub_dataset("openai/gsm8k")
    (tmp_path / "datasets" / "owner___prepared").mkdir(parents=True)
    check_hub_dataset("owner/prepared")
    for local in ("tinymath", "rows.jsonl", "./data/rows", str(tmp_path)):
        check_hub_dataset(local)
    assert asked == ["opnai/gsm8k", "openai/gsm8k"]


def test_the_hub_is_dialled_on_the_port_its_endpoint_names(monkeypatch):
    """A mirror at ``http://host:8080`` (HF_ENDPOINT) is dialled there, not on 443; an https
    endpoint without a port on 443, a plain http one on 80."""
    import socket

    from huggingface_hub import constants

    from lightning_troll.models.loading import hub_unreachable

    dialled = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        socket,
        "create_connection",
        lambda address, timeout=None: dialled.append(address) or socket.socket(),
    )
    for endpoint in ("http://mirror.local:8080", "https://hub.example", "http://plain.example/x"):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        assert hub_unreachable(1.0) is None
    assert dialled == [("mirror.local", 8080), ("hub.example", 443), ("plain.example", 80)]
