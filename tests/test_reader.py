"""Parquet in: real files in tmp_path, read back through read_input."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.config import ConfigError, InputConfig
from batchllm.rows.blocks import read_block, read_index
from batchllm.rows.reader import input_files, read_input


def _write(path, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_single_file_with_ids_and_null_prompt(tmp_path):
    f = _write(tmp_path / "in.parquet", id=["a", "b", "c"], prompt=["x", None, "z"])
    rows = read_input(InputConfig(path=str(f)))
    assert rows.num_rows == 3 and rows.ids.type == pa.string()
    assert rows.ids.to_pylist() == ["a", "b", "c"]
    assert rows.prompts == ["x", None, "z"] and rows.messages is None
    assert rows.overrides == {} and rows.files == (str(f),)


def test_row_index_when_no_id_column(tmp_path):
    f = _write(tmp_path / "in.parquet", prompt=["x", "y"])
    for cfg in (InputConfig(path=str(f)), InputConfig(path=str(f), id_column=None)):
        rows = read_input(cfg)
        assert rows.ids.type == pa.int64() and rows.ids.to_pylist() == [0, 1]


def test_id_column_keeps_its_type(tmp_path):
    f = _write(tmp_path / "in.parquet", key=pa.array([7, 3], pa.int32()), prompt=["x", "y"])
    rows = read_input(InputConfig(path=str(f), id_column="key"))
    assert rows.ids.type == pa.int32() and rows.ids.to_pylist() == [7, 3]


def test_folder_sorted_recursive_skipping_hidden(tmp_path):
    d = tmp_path / "data"
    _write(d / "part-1.parquet", prompt=["b"])
    _write(d / "part-0.parquet", prompt=["a"])
    _write(d / "sub" / "part-2.parquet", prompt=["c"])
    _write(d / "_tmp" / "part-9.parquet", prompt=["hidden"])
    _write(d / ".x.parquet", prompt=["hidden"])
    (d / "_SUCCESS").write_text("")
    rows = read_input(InputConfig(path=str(d)))
    assert rows.prompts == ["a", "b", "c"] and rows.ids.to_pylist() == [0, 1, 2]


def test_glob(tmp_path):
    _write(tmp_path / "b.parquet", prompt=["b"])
    _write(tmp_path / "a.parquet", prompt=["a"])
    _write(tmp_path / "other.parquet", prompt=["no"])
    assert read_input(InputConfig(path=str(tmp_path / "[ab].parquet"))).prompts == ["a", "b"]
    with pytest.raises(ConfigError, match=r"input.path: no files match .*zz\*"):
        input_files(str(tmp_path / "zz*"))


def test_messages_column(tmp_path):
    conv = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            None, [{"role": "user", "content": "Yo"}]]
    f = _write(tmp_path / "in.parquet", messages=conv)
    rows = read_input(InputConfig(path=str(f), messages_column="messages"))
    assert rows.prompts is None and rows.messages == conv


def test_messages_column_wrong_type(tmp_path):
    f = _write(tmp_path / "in.parquet", messages=["just text"])
    with pytest.raises(ConfigError, match="input.messages_column: column 'messages' has type"):
        read_input(InputConfig(path=str(f), messages_column="messages"))


def test_per_row_overrides(tmp_path):
    f = _write(tmp_path / "in.parquet", prompt=["a", "b", "c"],
               max_tokens=pa.array([5, None, 7], pa.int32()),
               temperature=[0.5, 0, None], stop=[["###"], None, []], unrelated=[1, 2, 3])
    rows = read_input(InputConfig(path=str(f)))
    assert rows.overrides == {"max_tokens": [5, None, 7], "temperature": [0.5, 0.0, None],
                              "stop": [("###",), None, ()]}
    only = read_input(InputConfig(path=str(f)), sampling_fields=("max_tokens",))
    assert list(only.overrides) == ["max_tokens"]


def test_float_max_tokens_from_pandas(tmp_path):
    f = _write(tmp_path / "in.parquet", prompt=["a", "b"], max_tokens=[16.0, None])
    assert read_input(InputConfig(path=str(f))).overrides["max_tokens"] == [16, None]


def test_per_row_values_pass_through_but_column_types_are_checked(tmp_path):
    # a value out of range becomes an error row in the engine; the job goes on
    f = _write(tmp_path / "in.parquet", prompt=["a", "b"], max_tokens=[4, -1], stop=["##", None])
    rows = read_input(InputConfig(path=str(f)))
    assert rows.overrides == {"max_tokens": [4, -1], "stop": [("##",), None]}
    g = _write(tmp_path / "bad.parquet", prompt=["a"], max_tokens=["64"])
    with pytest.raises(ConfigError) as e:
        read_input(InputConfig(path=str(g)))
    assert str(e.value) == ("input column 'max_tokens' (per-row sampling.max_tokens) has type "
                            "string; expected integers")
    # a float column of an integer field: its whole numbers are integers, any other value is
    # left for the row's check (an error row), not the column's (which would end the job)
    h = _write(tmp_path / "frac.parquet", prompt=["a", "b", "c"], top_k=[1.5, 2.0, 1e300])
    assert read_input(InputConfig(path=str(h))).overrides["top_k"] == [1.5, 2, int(1e300)]


def test_missing_prompt_column_names_the_field(tmp_path):
    f = _write(tmp_path / "in.parquet", text=["a"], promt=["b"])
    with pytest.raises(ConfigError) as e:
        read_input(InputConfig(path=str(f)))
    assert str(e.value) == (f"input.prompt_column: column 'prompt' not found in {f}; "
                            "did you mean promt?")
    with pytest.raises(ConfigError, match="columns are: text, promt"):
        read_input(InputConfig(path=str(f), prompt_column="zzz"))


def test_prompt_column_must_be_text(tmp_path):
    f = _write(tmp_path / "in.parquet", prompt=[1, 2])
    with pytest.raises(ConfigError, match="input.prompt_column: column 'prompt' has type int64"):
        read_input(InputConfig(path=str(f)))


def test_named_id_column_missing(tmp_path):
    f = _write(tmp_path / "in.parquet", prompt=["a"])
    with pytest.raises(ConfigError, match="input.id_column: column 'doc_id' not found"):
        read_input(InputConfig(path=str(f), id_column="doc_id"))


def test_id_column_in_some_files_only(tmp_path):
    _write(tmp_path / "d" / "a.parquet", id=[1], prompt=["a"])
    _write(tmp_path / "d" / "b.parquet", prompt=["b"])
    with pytest.raises(ConfigError, match="input.id_column: column 'id' not found in .*b.parquet"):
        read_input(InputConfig(path=str(tmp_path / "d")))


def test_duplicate_and_null_ids(tmp_path):
    f = _write(tmp_path / "in.parquet", id=["a", "b", "a", "c", "c"], prompt=list("vwxyz"))
    with pytest.raises(ConfigError) as e:
        read_input(InputConfig(path=str(f)))
    assert str(e.value) == "input.id_column: 2 ids appear more than once: 'a', 'c'"
    # duplicates across files count too
    _write(tmp_path / "d" / "a.parquet", id=[1, 2], prompt=["a", "b"])
    _write(tmp_path / "d" / "b.parquet", id=[2, 3], prompt=["c", "d"])
    with pytest.raises(ConfigError, match="1 ids appear more than once: 2"):
        read_input(InputConfig(path=str(tmp_path / "d")))
    g = _write(tmp_path / "nulls.parquet", id=["a", None], prompt=["x", "y"])
    with pytest.raises(ConfigError, match="column 'id' has 1 null values"):
        read_input(InputConfig(path=str(g)))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match=r"input.path: '.*nope.parquet' does not exist"):
        read_input(InputConfig(path=str(tmp_path / "nope.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .parquet files"):
        read_input(InputConfig(path=str(tmp_path / "empty")))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ConfigError, match=r"input.path: cannot read .*bad.parquet as Parquet"):
        read_input(InputConfig(path=str(bad)))


def test_legal_data_matches_its_script():
    """data/legal/prompts.parquet is what scripts/make_legal_data.py writes (rerun it if not)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("make_legal_data",
                                                  root / "scripts" / "make_legal_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ids, prompts = script.make_rows()
    rows = read_input(InputConfig(path=str(root / "data" / "legal" / "prompts.parquet")))
    assert rows.ids.to_pylist() == ids and rows.prompts == prompts
    assert rows.num_rows == 256 and len(set(prompts)) == 256


@pytest.mark.parametrize("id_column", ["id", None])
def test_blocks_read_back_as_read_input(tmp_path, id_column):
    """read_index + read_block (engine.sharding: partition) give the rows of read_input: two files
    of 3 row groups each, blocks of whole row groups."""
    d = tmp_path / "data"
    d.mkdir()
    for f, lo in (("a.parquet", 0), ("b.parquet", 9)):
        n = 9 if lo == 0 else 7
        table = pa.table({"id": [f"r{lo + i}" for i in range(n)],
                          "prompt": [f"p{lo + i}" for i in range(n)],
                          "max_tokens": pa.array([lo + i if i % 2 else None for i in range(n)],
                                                 pa.int64())})
        pq.write_table(table, d / f, row_group_size=3)
    cfg = InputConfig(path=str(d), id_column=id_column)
    whole = read_input(cfg)
    index = read_index(cfg, block_rows=5)
    assert index.num_rows == 16 and index.ids.equals(whole.ids) and index.files == whole.files
    assert [(b.first_row, b.num_rows) for b in index.blocks] == [(0, 6), (6, 3), (9, 6), (15, 1)]
    blocks = [read_block(cfg, b) for b in index.blocks]
    assert [i for b in blocks for i in b.ids.to_pylist()] == whole.ids.to_pylist()
    assert [p for b in blocks for p in b.prompts] == whole.prompts
    assert [m for b in blocks for m in b.overrides["max_tokens"]] == whole.overrides["max_tokens"]


def test_index_checks_ids_and_text_column(tmp_path):
    f = _write(tmp_path / "in.parquet", id=["a", "a"], prompt=["x", "y"])
    with pytest.raises(ConfigError, match="ids appear more than once"):
        read_index(InputConfig(path=str(f)))
    with pytest.raises(ConfigError, match="input.prompt_column.*'text'"):
        read_index(InputConfig(path=str(f), prompt_column="text", id_column=None))


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_csv_read_as_parquet_does(tmp_path):
    rows = [{"id": "a", "prompt": "x", "max_tokens": 5, "stop": ["##"]},
            {"id": "b", "prompt": None, "max_tokens": None, "stop": None},
            {"id": "c", "prompt": "z", "max_tokens": 7, "stop": []}]
    want = read_input(InputConfig(path=str(_write(tmp_path / "in.parquet", **{
        k: [r[k] for r in rows] for k in rows[0]}))))
    got = read_input(InputConfig(path=str(_jsonl(tmp_path / "in.jsonl", rows))))
    assert got.ids.to_pylist() == want.ids.to_pylist() and got.prompts == want.prompts
    assert got.overrides == want.overrides == {"max_tokens": [5, None, 7],
                                               "stop": [("##",), None, ()]}
    csv = tmp_path / "in.csv"
    csv.write_text("id,prompt,temperature\n7,42,0.5\n8,Who pays?,\n")
    rows = read_input(InputConfig(path=str(csv)))
    assert rows.ids.to_pylist() == [7, 8] and rows.prompts == ["42", "Who pays?"]  # text stays
    assert rows.overrides == {"temperature": [0.5, None]}
    odd = tmp_path / "prompts.txt"  # any extension, with the format given
    odd.write_text(csv.read_text())
    assert read_input(InputConfig(path=str(odd), format="csv")).prompts == ["42", "Who pays?"]


def test_jsonl_messages_and_folders(tmp_path):
    conv = [{"role": "user", "content": "Hi"}]
    f = _jsonl(tmp_path / "d" / "b.jsonl", [{"messages": conv}, {"messages": None}])
    _jsonl(tmp_path / "d" / "a.ndjson", [{"messages": conv}])
    rows = read_input(InputConfig(path=str(f.parent), messages_column="messages"))
    assert rows.messages == [conv, conv, None] and rows.files[0].endswith("a.ndjson")
    _write(tmp_path / "d" / "c.parquet", messages=[conv])  # auto: a folder's Parquet first
    assert read_input(InputConfig(path=str(f.parent), messages_column="messages")).num_rows == 1
    with pytest.raises(ConfigError, match=r"holds no .csv files"):
        read_input(InputConfig(path=str(f.parent), format="csv"))


def test_a_broken_jsonl_line_fails_its_row_or_with_ids_the_file(tmp_path):
    """A line that is not a JSON object is an error row naming the line where rows are known by
    their index; where the rows have ids, its id is unknown, and the file is refused, naming
    the line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"prompt": \n[1, 2]\n{"prompt": "y"}\n')
    rows = read_input(InputConfig(path=str(bad)))
    assert rows.prompts == ["x", None, None, "y"] and rows.ids.to_pylist() == [0, 1, 2, 3]
    assert rows.errors[1].startswith("input.prompt_column: line 2 is not valid JSON")
    assert rows.errors[2] == "input.prompt_column: line 3 is not a JSON object"
    bad.write_text('{"id": 1, "prompt": "x"}\n{"id": 2, "prompt": \n')
    with pytest.raises(ConfigError, match=r"input.path: cannot read .*bad.jsonl as JSON Lines: "
                                          r"line 2 is not valid JSON .*, so the row's 'id' is "
                                          r"unknown"):
        read_input(InputConfig(path=str(bad)))


def test_an_openai_batch_file_in_disguise(tmp_path):
    batch = _jsonl(tmp_path / "batch.jsonl", [{"custom_id": "a", "method": "POST", "url": "u",
                                               "body": {"prompt": "x"}}])
    with pytest.raises(ConfigError, match="looks like an OpenAI Batch file: set input.format: "
                                          "openai-batch"):
        read_input(InputConfig(path=str(batch)))
