"""Rows from JSONL (plain, gzip, zstandard), Parquet and datasets' save_to_disk folders, against
what json, pyarrow and datasets themselves read back from files they wrote here; the bad-row rules;
and `prepare` on the same rows in each format."""

import gzip
import json
import os
import pathlib

import pytest
import zstandard

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from paxlite.data.errors import DatasetError
from paxlite.data.inputs import iter_documents
from paxlite.data.prepare import main as prepare_main
from paxlite.data.prepare import prepare
from paxlite.data.records import read_info, shard_paths
from paxlite.data.row_files import (
    BadRows,
    Column,
    SkippedRows,
    iter_checked_rows,
    iter_rows,
    saved_dataset_files,
)

CHATS = [
    {"messages": [{"role": "user", "content": f"question {i}"},
                  {"role": "assistant", "content": f"answer {i} " * (i % 3 + 1)}],
     "id": i}
    for i in range(7)
]
TEXT = {"text": [f"document {i} " + "word " * (i % 4) for i in range(25)]}
TEXT_COLUMN = [Column("text", (str,), "a string")]


def rows_of(path, **kwargs):
    return list(iter_rows(str(path), **kwargs))


def write_lines(path, lines: list[str]) -> str:
    data = "".join(line + "\n" for line in lines).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("name", ["chats.jsonl", "chats.jsonl.gz", "chats.json.zst"])
def test_jsonl_rows_and_their_lines(tmp_path, name):
    lines = [json.dumps(row) for row in CHATS]
    lines.insert(3, "   ")  # a blank line is no row, but it counts as a line
    path = write_lines(tmp_path / name, lines)
    rows = rows_of(path)
    assert [row for _, row in rows] == [json.loads(line) for line in lines if line.strip()]
    assert [where for where, _ in rows] == [f"{path}:{n}" for n in (1, 2, 3, 5, 6, 7, 8)]


def test_parquet_rows_equal_pyarrows_by_row_group_and_read_only_the_columns_asked_for(tmp_path):
    table = pa.Table.from_pylist(CHATS * 300)  # 2100 rows: 5 row groups, several batches
    path = str(tmp_path / "chats.parquet")
    pq.write_table(table, path, row_group_size=500)
    rows = rows_of(path)
    assert [row for _, row in rows] == pq.read_table(path).to_pylist()
    assert rows[1234][0] == f"{path}:row 1234"
    ids = rows_of(path, columns=["id"])
    assert [row for _, row in ids] == pq.read_table(path, columns=["id"]).to_pylist()


def test_save_to_disk_rows_equal_load_from_disk_in_state_json_order(tmp_path):
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_list(CHATS * 3).save_to_disk(folder, num_shards=3)
    # state.json decides the order, not the file names: list the shards backwards.
    state_path = tmp_path / "saved" / "state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"].reverse()
    state_path.write_text(json.dumps(state))
    expected = list(datasets.load_from_disk(folder))
    rows = rows_of(folder)
    assert [row for _, row in rows] == expected
    last_file = os.path.join(folder, "data-00000-of-00003.arrow")
    assert rows[-1][0] == f"{last_file}:row 6"
    assert saved_dataset_files(folder, split=None)[-1] == last_file


def test_dataset_dict_needs_its_split(tmp_path):
    folder = str(tmp_path / "dict")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(CHATS[:5]),
        "test": datasets.Dataset.from_list(CHATS[5:]),
    }).save_to_disk(folder)
    rows = rows_of(folder, split="test")
    assert [row for _, row in rows] == list(datasets.load_from_disk(folder)["test"])
    with pytest.raises(DatasetError) as missing:
        rows_of(folder)
    assert str(missing.value) == (
        f"{folder} is a DatasetDict folder and needs a split: choose one of train, test with "
        "--split")
    with pytest.raises(DatasetError, match=r"has no split 'dev': choose one of train, test with "
                                           r"CHAT_SPLIT$"):
        rows_of(folder, split="dev", split_setting="CHAT_SPLIT")


def test_a_folder_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    write_lines(tmp_path / "b" / "one.jsonl", [json.dumps(CHATS[0])])
    pq.write_table(pa.Table.from_pylist(CHATS[1:3]), tmp_path / "a.parquet")
    datasets.Dataset.from_list(CHATS[3:5]).save_to_disk(str(tmp_path / "c"))
    (tmp_path / "notes.txt").write_text("not rows")
    rows = rows_of(tmp_path)
    assert [row for _, row in rows] == [CHATS[i] for i in (1, 2, 0, 3, 4)]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="holds no row files"):
        rows_of(empty)
    with pytest.raises(DatasetError, match=r"unsupported row file .*notes\.txt"):
        rows_of(tmp_path / "notes.txt")


BAD_LINES = [  # (line, the error after "file:line: ")
    ('{"body": "no text"}', "no column 'text' (the row has 'body'); expected a string"),
    ('{"text": 7}', "column 'text' is int, expected a string"),
    ('{"text": "  "}', "column 'text' is empty, expected a string"),
    ('{"text": "bad json"',
     "not valid JSON (Expecting ',' delimiter); expected one object per line"),
    ('["not", "an object"]', "a JSON list, expected an object"),
    ('{"text": null}', "column 'text' is null, expected a string"),
]


@pytest.mark.parametrize("line,error", BAD_LINES)
def test_each_bad_row_is_one_line_naming_file_line_and_column(tmp_path, line, error):
    path = write_lines(tmp_path / "bad.jsonl", ['{"text": "good"}', line])
    with pytest.raises(DatasetError) as raised:
        list(iter_checked_rows(path, columns=TEXT_COLUMN))
    assert str(raised.value) == f"{path}:2: {error}"


def test_skip_counts_every_bad_row_and_keeps_the_good_ones(tmp_path):
    lines = ['{"text": "good"}', *(line for line, _ in BAD_LINES), '{"text": "also good"}']
    path = write_lines(tmp_path / "bad.jsonl", lines)
    skipped = SkippedRows()
    rows = list(iter_checked_rows(path, columns=TEXT_COLUMN, on_bad_row=BadRows.SKIP,
                                  skipped=skipped))
    assert [(where, row["text"]) for where, row in rows] == [
        (f"{path}:1", "good"), (f"{path}:8", "also good")]
    assert skipped.total == 6
    assert skipped.by_reason == {
        "missing column 'text'": 1, "wrong type in 'text'": 2, "empty 'text'": 1,
        "invalid JSON": 1, "not a JSON object": 1}
    assert skipped.first == f"{path}:2: {BAD_LINES[0][1]}"
    assert skipped.summary() == (
        "skipped 6 bad rows (1 missing column 'text', 2 wrong type in 'text', 1 empty 'text', "
        f"1 invalid JSON, 1 not a JSON object); the first: {path}:2: {BAD_LINES[0][1]}")
    assert SkippedRows().summary() == ""
    with pytest.raises(ValueError, match="needs a SkippedRows"):
        iter_checked_rows(path, columns=TEXT_COLUMN, on_bad_row=BadRows.SKIP)


def test_bad_parquet_row_names_file_and_row(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": ["a", "b", None, "d"], "n": [1, 2, 3, 4]}), path)
    with pytest.raises(DatasetError) as error:
        list(iter_checked_rows(path, columns=TEXT_COLUMN))
    assert str(error.value) == f"{path}:row 2: column 'text' is null, expected a string"
    with pytest.raises(DatasetError) as error:
        list(iter_checked_rows(path, columns=[Column("body", (str,), "a string", hint="; X")]))
    assert str(error.value) == (
        f"{path}:row 0: no column 'body' (the row has 'text', 'n'); expected a string; X")


def dataset_bytes(directory) -> dict[str, bytes]:
    info = read_info(directory)
    return {os.path.basename(p): pathlib.Path(p).read_bytes()
            for split in sorted(info.splits) for p in shard_paths(info, split)}


def test_prepare_on_parquet_and_save_to_disk_equals_prepare_on_jsonl(tmp_path):
    rows = [{"text": t, "n": i} for i, t in enumerate(TEXT["text"])]
    rows.insert(4, {"text": "", "n": -1})  # an empty document is skipped, as in JSONL
    write_lines(tmp_path / "rows.jsonl", [json.dumps(r) for r in rows])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=8)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dict"))
    settings = dict(num_shards=2, validation_fraction=0.2, seed=3)
    reference = prepare([tmp_path / "rows.jsonl"], tmp_path / "from_jsonl", **settings)
    assert reference.splits["train"].documents + reference.splits["validation"].documents == 25
    for name, split in [("rows.parquet", None), ("saved", None), ("dict", "train")]:
        info = prepare([tmp_path / name], tmp_path / f"from_{name}", split=split, **settings)
        assert info.splits == reference.splits
        assert dataset_bytes(tmp_path / f"from_{name}") == dataset_bytes(tmp_path / "from_jsonl")
    documents = list(iter_documents([tmp_path / "rows.parquet"], text_field="text"))
    assert documents == TEXT["text"]


def test_prepare_command_line(tmp_path, monkeypatch, capsys):
    pq.write_table(pa.table({"body": ["one document", "another"]}), tmp_path / "t.parquet")
    status = prepare_main(["--input", str(tmp_path / "t.parquet"), "--output_dir",
                           str(tmp_path / "a"), "--text_field", "body"])
    assert status == 0
    assert prepare_main(["--input", str(tmp_path / "t.parquet"), "--output_dir",
                         str(tmp_path / "b"), "--text_column", "body"]) == 0
    assert dataset_bytes(tmp_path / "a") == dataset_bytes(tmp_path / "b")
    capsys.readouterr()

    def error_of(*args: str) -> str:
        assert prepare_main(list(args)) == 2
        return capsys.readouterr().err

    where = str(tmp_path / "t.parquet")
    assert error_of("--input", where, "--output_dir", str(tmp_path / "c")) == (
        f"prepare: error: {where}:row 0: no column 'text' (the row has 'body'); expected a "
        "string; choose the column with --text_column\n")
    assert error_of("--input", where, "--output_dir", str(tmp_path / "c"), "--split",
                    "train") == ("prepare: error: --split=train chooses the split of "
                                 "--hf_dataset or of a DatasetDict folder, and no --input is "
                                 "one\n")
    assert error_of("--hf_dataset", "user/set", "--output_dir", str(tmp_path / "c")) == (
        "prepare: error: --hf_dataset=user/set needs --split (e.g. --split=train)\n")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if not installed
    assert error_of("--hf_dataset", "user/set:cfg", "--split", "train", "--output_dir",
                    str(tmp_path / "c")) == (
        "prepare: error: --hf_dataset needs the datasets package: pip install datasets\n")
    with pytest.raises(SystemExit) as both:
        prepare_main(["--input", where, "--hf_dataset", "x", "--output_dir", "d"])
    assert both.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
