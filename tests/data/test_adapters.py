import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptforge.core.errors import DataError
from gptforge.data.formats import normalise, parse_hh, to_messages, to_pair, to_text
from gptforge.core.config import SourceSection
from gptforge.data.sources import read_rows


def read_local(path):
    return read_rows(SourceSection(path=str(path)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_from_txt_jsonl_json_parquet_folder_and_glob(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("first doc\n\nsecond doc\n")
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "third"}, {"text": "fourth"}])
    (tmp_path / "d" / "c.json").write_text(json.dumps([{"text": "fifth"}]))
    pq.write_table(pa.table({"text": ["sixth", "seventh"]}), tmp_path / "d" / "e.parquet")
    out = normalise(read_local(tmp_path / "d"), to_text, "fail", "text")
    assert out.items == ["first doc", "second doc", "third", "fourth", "fifth", "sixth", "seventh"]
    globbed = normalise(read_local(tmp_path / "d" / "*.jsonl"), to_text, "fail", "text")
    assert globbed.items == ["third", "fourth"]


def test_chat_formats_normalise_to_messages():
    alpaca = {"instruction": "Add", "input": "2 and 3", "output": "5"}
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    openai = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    assert to_messages(alpaca)["messages"] == [{"role": "user", "content": "Add\n\n2 and 3"},
                                               {"role": "assistant", "content": "5"}]
    assert to_messages(sharegpt)["messages"] == [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]
    assert to_messages(openai) == openai


def test_tool_use_demonstrations_normalise_to_the_templates_shape():
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}
    row = {"tools": [schema], "messages": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "name": "add", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5"}]}
    out = to_messages(row)
    assert out["tools"] == [{"type": "function", "function": schema}]
    assert out["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert out["messages"][2] == {"role": "tool", "content": "5", "name": "add"}
    bare = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {}}]}]}
    assert to_messages(bare)["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {}}
    for bad, why in [({"name": "add", "arguments": "{not json"}, "message 1 tool call 0 (add): arguments are not JSON"),
                     ({"arguments": {}}, "message 1 tool call 0 needs a function name")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            to_messages({"messages": [{"role": "user", "content": "x"},
                                      {"role": "assistant", "content": "", "tool_calls": [bad]}]})
    with pytest.raises(ValueError, match="tools should be a list of JSON schemas"):
        to_messages({"tools": "add", "messages": [{"role": "user", "content": "x"}]})


def test_preference_formats_normalise_to_pairs():
    flat = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    ultra = {"prompt": "2+2?", "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}
    hh = {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"}
    want = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}
    assert to_pair(flat) == want
    assert to_pair(ultra) == want
    assert to_pair(hh) == want


def test_hh_multi_turn():
    msgs = parse_hh("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: 4")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[-1]["content"] == "4"


def test_bad_rows_are_named_by_file_and_line(tmp_path, capsys):
    f = tmp_path / "chat.jsonl"
    f.write_bytes(b'{"instruction": "a", "output": "b"}\n{not json\n{"instruction": "a"}\n\xff\xfe\n'
                  b'{"messages": [{"role": "robot", "content": "x"}]}\n')
    out = normalise(read_local(f), to_messages, "skip", "chat")
    assert len(out.items) == 1 and out.bad_rows == 4
    err = capsys.readouterr().err
    for line, reason in [(2, "malformed JSON"), (3, "missing field 'output'"), (4, "undecodable line"),
                         (5, "message 0 has role 'robot'")]:
        assert f"{f}:{line}: skipped bad chat row: {reason}" in err
    with pytest.raises(DataError, match=rf"{f}:2: bad chat row: malformed JSON"):
        normalise(read_local(f), to_messages, "fail", "chat")


def test_missing_file_and_empty_corpus(tmp_path):
    with pytest.raises(DataError, match=r"^file not found: .*nope\.jsonl$"):
        list(read_local(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "   "}\n')
    with pytest.raises(DataError, match=r"no usable text rows after filtering \(2 bad rows skipped\)"):
        normalise(read_local(empty), to_text, "skip", "text")
