"""Prompt files as read (``ppo/data.py``): whatever is wrong with a JSON file is one line naming
the file and the row, from the project's own reading; what is right loads the rows ``json``
reads, and the rows the ``datasets`` library read before."""

from __future__ import annotations

import codecs
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_paro.config import ConfigError
from rlhf_paro.ppo import data
from tests import hf_assets

KEY = "data.train_files"
LINES = "allowed: one JSON object on each line"
ARRAY = "allowed: a JSON array of objects, or one JSON object on each line"
GOOD = b'{"prompt": "count : a", "start": 1}\n'


def read(path) -> list[tuple[int, dict]]:
    """(row number, row) of each row of ``path`` as the run reads it."""
    (_, table), = data._read([str(path)], KEY)
    return list(table.rows)


def refusal(path) -> str:
    with pytest.raises(ConfigError) as info:
        read(path)
    return str(info.value)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    return {"llama": hf_assets.save_llama(root / "llama", hf_assets.word_tokenizer()),
            "prompts": hf_assets.write_prompts(root / "prompts.jsonl", 20)}


def test_a_line_that_is_a_list_stops_the_command_in_one_line_naming_the_file_and_row(
        tmp_path, user_files):
    # Before: two lines, datasets' "Failed to load JSON ... ArrowInvalid ..." and
    # "error: data.train_files: cannot read ...: JSON parse error: ... in row 0".
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(user_files["prompts"].read_bytes() + b"[1, 2]\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.train",
                           f"actor.path={user_files['llama']}", f"data.train_files={prompts}",
                           f"trainer.output_dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr == (f"error: {KEY}: {str(prompts)!r} row 21 is a list ([1, 2]), not a "
                           f"JSON object; {LINES}\n"), proc.stderr
    assert not out.exists()


# (the file's bytes, what its one line says after the file's name). Before, each was a line of
# datasets' logging and a pyarrow message ("... in row 0", counted from 0 and from where
# pyarrow's block began), or, for a lone surrogate, a TypeError traceback from the tokenizer.
BAD_FILES = {
    "list": (GOOD + b"[1, 2]\n", f" row 2 is a list ([1, 2]), not a JSON object; {LINES}"),
    "scalar": (GOOD * 2 + b"7\n", f" row 3 is an int (7), not a JSON object; {LINES}"),
    "null": (GOOD + b"null\n", f" row 2 is null, not a JSON object; {LINES}"),
    # Before: the command ended in a segmentation fault inside datasets' JSON reader.
    "only_null": (b"null\n", f" row 1 is null, not a JSON object; {LINES}"),
    "string": (b'"count : a"\n', f" row 1 is a str (count : a), not a JSON object; {LINES}"),
    "repeated_key": (GOOD + b'{"prompt": "a", "start": 1, "prompt": "b"}\n',
                     " row 2 has the key 'prompt' twice in one object; allowed: each key once"),
    "repeated_nested_key": (b'{"prompt": [{"role": "user", "role": "x", "content": "a"}]}\n',
                            " row 1 has the key 'role' twice in one object; allowed: each key "
                            "once"),
    "broken": (GOOD + b'{"prompt": "a", "start": \n' + GOOD,
               f" row 2 is not JSON (Expecting value at column 26); {LINES}"),
    "two_objects": (GOOD.strip() + GOOD, f" row 1 is not JSON (Extra data at column 36); {LINES}"),
    "not_utf8": (GOOD * 4 + b'{"prompt": "\xff"}\n', " row 5 is not UTF-8 text; allowed: UTF-8 "
                                                      "files"),
    "lone_surrogate": (GOOD + b'{"prompt": "a \\udcff b"}\n',
                       " row 2 holds text with '\\udcff' at character 2, a lone surrogate; "
                       "allowed: valid Unicode"),
    "too_many_digits": (b'{"prompt": "a", "start": ' + b"9" * 5000 + b"}\n",
                        " row 1 cannot be read (ValueError: Exceeds the limit (4300 digits)"),
    "too_deep": (b'{"prompt": "a", "start": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
                 " row 1 cannot be read (RecursionError: maximum recursion depth exceeded"),
    "array_in_jsonl": (b'[{"prompt": "a"}]\n', " row 1 is a list ([{'prompt': 'a'}]), not a "
                                               f"JSON object; {LINES}"),
    "blank_only": (b"\n  \n\r\n", " holds no rows; allowed: at least one prompt"),
    # .json: an array of objects, one object, or JSON lines.
    "array_of_a_list.json": (b'[\n  {"prompt": "a"},\n  [1]\n]\n',
                             f" row 2 (line 3) is a list ([1]), not a JSON object; {ARRAY}"),
    "array_repeated_key.json": (b'[{"prompt": "a"},\n{"prompt": "a", "prompt": "b"}]',
                                " row 2 (line 2) has the key 'prompt' twice in one object; "
                                "allowed: each key once"),
    "array_broken.json": (b'[{"prompt": "a"},\n {"prompt": }]',
                          f" is not JSON (Expecting value at line 2 column 13); {ARRAY}"),
    "array_not_utf8.json": (b'[{"prompt": "a"},\n\n {"prompt": "\xfe"}]',
                            " line 3 is not UTF-8 text; allowed: UTF-8 files"),
    "scalar.json": (b"3\n", f" is an int (3); {ARRAY}"),
    "lines_with_a_list.json": (GOOD + b"[1]\n", f" row 2 is a list ([1]), not a JSON object; "
                                                f"{ARRAY}"),
    "empty_array.json": (b"[ ]", " holds no rows; allowed: at least one prompt"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_json_file_is_one_line_naming_the_file_and_the_row_and_nothing_else(
        tmp_path, capfd, case):
    contents, said = BAD_FILES[case]
    path = tmp_path / (case if case.endswith(".json") else f"{case}.jsonl")
    path.write_bytes(contents)
    line = refusal(path)
    assert line.startswith(f"{KEY}: {str(path)!r}{said}") and "\n" not in line, line
    assert capfd.readouterr() == ("", "")  # no library's logging on the way


# Files every reader took: the rows of each as datasets read them.
GOOD_FILES = {
    "lines.jsonl": b'{"prompt": "a", "n": 1}\n{"prompt": "b", "n": 2}\n',
    "no_final_newline.jsonl": b'{"prompt": "a"}\n{"prompt": "b"}',
    "blank_lines.jsonl": b'\n{"prompt": "a"}\n\n  \n{"prompt": "b"}\n\n',
    "crlf.jsonl": b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n',
    "bom.jsonl": b'\xef\xbb\xbf{"prompt": "a"}\n',
    "missing_column.jsonl": b'{"prompt": "a", "n": 1}\n{"prompt": "b"}\n',
    "chat.jsonl": json.dumps({"prompt": [{"role": "user", "content": "h\u00e9 \U0001F600"}]}
                             ).encode() + b"\n",
    "array.json": b'[{"prompt": "a", "n": 1},\n {"prompt": "b", "n": 2}]',
    "pretty_array.json": b'[\n  {\n    "prompt": "a"\n  },\n  {\n    "prompt": "b"\n  }\n]\n',
    "one_object.json": b'{\n  "prompt": "a"\n}\n',
    "lines.json": b'{"prompt": "a"}\n{"prompt": "b"}\n',
}


@pytest.mark.parametrize("name", list(GOOD_FILES))
def test_a_good_json_file_loads_the_rows_datasets_loaded(tmp_path, name):
    import datasets

    path = tmp_path / name
    path.write_bytes(GOOD_FILES[name])
    datasets.disable_progress_bars()
    expected = list(datasets.load_dataset("json", data_files=str(path), split="train",
                                          cache_dir=str(tmp_path / "cache")))
    assert [row for _, row in read(path)] == expected


def test_rows_are_numbered_by_their_line_in_json_lines_and_their_place_in_an_array(tmp_path):
    lines, array = tmp_path / "a.jsonl", tmp_path / "a.json"
    lines.write_bytes(b'\n{"prompt": "a"}\n\n{"prompt": "b"}\n')
    array.write_bytes(b'[\n{"prompt": "a"},\n\n{"prompt": "b"}]')
    assert [n for n, _ in read(lines)] == [2, 4]
    assert [n for n, _ in read(array)] == [1, 2]


def test_parquet_files_still_load_and_a_broken_one_is_one_line(tmp_path, capfd):
    import datasets

    path = tmp_path / "prompts.parquet"
    rows = [{"prompt": "count : a", "start": 1}, {"prompt": "count : b", "start": 2}]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    assert read(path) == [(1, rows[0]), (2, rows[1])]
    capfd.readouterr()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not a parquet file PAR1")
    line = refusal(broken)
    assert line.startswith(f"{KEY}: cannot read {str(broken)!r}: ") and "\n" not in line, line
    # Before, datasets also logged "Failed to read schema from ..." on a line of its own.
    assert capfd.readouterr() == ("", "")


# -- fuzz: a .jsonl file loads the rows json.loads reads, or is one line naming its first bad line

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                      allow_infinity=False) | TEXT,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
OBJECTS = st.dictionaries(TEXT, VALUES, max_size=4)


@st.composite
def _line(draw) -> bytes:
    """A line of a prompt file: mostly objects, and each kind of fault."""
    kind = draw(st.sampled_from(["object", "object", "object", "blank", "value", "broken",
                                 "repeated", "surrogate", "text", "bytes"]))
    ascii_only = draw(st.booleans())  # \u escapes, or the characters as UTF-8
    if kind == "object":
        return json.dumps(draw(OBJECTS), ensure_ascii=ascii_only).encode()
    if kind == "blank":
        return draw(st.sampled_from([b"", b" ", b"\t", b"\r", b" \r"]))
    if kind == "value":  # a list, a number, a string, true or null where an object belongs
        value = draw(VALUES.filter(lambda v: not isinstance(v, dict)))
        return json.dumps(value, ensure_ascii=ascii_only).encode()
    if kind == "broken":
        text = json.dumps(draw(OBJECTS), ensure_ascii=ascii_only)
        return text[:draw(st.integers(1, len(text) - 1))].encode()
    if kind == "repeated":  # one key twice, among others, at any depth
        name, value, more = draw(TEXT), draw(VALUES), draw(OBJECTS)
        pairs = [f"{json.dumps(name)}: {json.dumps(value)}"] * 2 + [
            f"{json.dumps(k)}: {json.dumps(v)}" for k, v in more.items() if k != name]
        text = "{" + ", ".join(draw(st.permutations(pairs))) + "}"
        return (f'{{"prompt": {text}}}' if draw(st.booleans()) else text).encode()
    if kind == "surrogate":  # a \u escape of half a pair
        return b'{"prompt": "a\\ud' + draw(st.sampled_from([b"800", b"bff", b"c00", b"fff"])) \
            + b'"}'
    if kind == "text":  # any text: mostly not JSON, now and then a value or an object
        return draw(st.text(st.characters(blacklist_categories=("Cs",),
                                          blacklist_characters="\n"), max_size=20)).encode()
    return draw(st.binary(max_size=12).filter(lambda b: b"\n" not in b))


def _no_repeats(pairs: list) -> dict:
    if len(dict(pairs)) < len(pairs):
        raise ValueError("a key twice")
    return dict(pairs)


def _judged(line: bytes) -> str:
    """What ``json`` makes of a line read alone: blank, a good row (one object of UTF-8 text,
    no key twice) or bad."""
    if not line.strip(b" \t\r"):
        return "blank"
    try:
        value = json.loads(line.decode("utf-8"), object_pairs_hook=_no_repeats)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate has no UTF-8
    except (ValueError, RecursionError):  # UnicodeError is a ValueError
        return "bad"
    return "good" if isinstance(value, dict) else "bad"


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(_line(), min_size=1, max_size=8), final_newline=st.booleans())
def test_fuzz_a_jsonl_file_loads_what_json_reads_or_names_its_first_bad_line(
        tmp_path, lines, final_newline):
    path = tmp_path / "fuzz.jsonl"
    contents = b"\n".join(lines) + (b"\n" if final_newline else b"")
    path.write_bytes(contents)
    # A file's leading byte order mark is no part of its first line, as editors save UTF-8.
    lines = contents.removeprefix(codecs.BOM_UTF8).split(b"\n")
    judged = [_judged(line) for line in lines]
    bad = [n for n, said in enumerate(judged, 1) if said == "bad"]
    expected = [(n, json.loads(line)) for n, (line, said) in enumerate(zip(lines, judged), 1)
                if said == "good"]
    if bad:
        line = refusal(path)
        assert line.startswith(f"{KEY}: {str(path)!r} row {bad[0]} ") and "\n" not in line, \
            (line, contents)
    elif not expected:
        said = ("is empty; allowed: a file with at least one prompt" if not contents else
                "holds no rows; allowed: at least one prompt")
        assert refusal(path) == f"{KEY}: {str(path)!r} {said}"
    else:
        columns = list(dict.fromkeys(c for _, row in expected for c in row))
        assert read(path) == [(n, {c: row.get(c) for c in columns}) for n, row in expected], \
            contents
