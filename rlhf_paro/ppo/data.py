"""Prompts from files: the actor's tokenizer, the prompt dataset, its seeded epochs, left padding.

``data.train_files`` are local files (nothing is downloaded): .jsonl files of one JSON object a
line, .json files of one array of objects (or JSON lines), both read here with ``json``, and
.parquet files read with the ``datasets`` library. Each row's ``data.prompt_key`` column holds a
string, or a list of chat messages ``[{"role": ..., "content": ...}]`` rendered with the
tokenizer's chat template (``data.apply_chat_template=true``; a string is then one user message).
The row's other columns travel with the prompt to a reward function (``ppo/rewards.py``).

Every row is checked as it is read: a line that is not JSON, not an object or names a key twice,
text that is not UTF-8 (or a ``\\u`` escape of a lone surrogate), a prompt that is neither a
string nor chat messages (null, a number), or messages the chat template refuses (an unknown
role) stop the run before it starts, in one line naming the file and the row, counted from 1 (a
.jsonl file's line).

Policy for long prompts: a prompt of more than ``data.max_prompt_length`` tokens is skipped, and
so is one that fills the shortest context of the run's models (no room for a response token);
the number skipped is printed once when the file is read, with the first rows named; a file with
no prompt left is an error.

Prompts of different lengths are left-padded for generation: the response then starts at the
same column in every row, and the models' position ids count valid tokens only
(``models.position_ids``), so a padded row computes what it computes alone.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import torch

from rlhf_paro.config import ROLES, Config, ConfigError, data_files
from rlhf_paro.ppo.rewards import ARGUMENTS
from rlhf_paro.usercode import described, one_line


def tokenizer_dir(cfg: Config) -> str | None:
    """The actor's tokenizer directory: ``actor.tokenizer``, else ``actor.path`` (None: an inline
    actor, which speaks the task's tokenizer)."""
    return cfg.actor.tokenizer or cfg.actor.path


# Text any tokenizer of a language model encodes into tokens: one that gives none has nothing to
# encode with (a folder without tokenizer files still loads, empty, as its model type's class).
PLAIN_TEXT = "The quick brown fox jumps over the lazy dog."


def load_tokenizer(directory: str, trust_remote_code: bool = False, key: str = "actor.tokenizer"
                   ) -> Any:
    """The tokenizer of a local directory, with a pad token (the eos token when it has none) and
    left padding for generation: ``AutoTokenizer``'s, or the directory's own ``tokenizer.json``
    as saved where the class ``AutoTokenizer`` picks by the model type encodes differently
    (``_as_saved``). ``ConfigError`` naming ``key`` and the directory when none loads or what
    loads encodes a plain sentence as no tokens."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code)
        tokenizer = _as_saved(tokenizer, Path(directory))
    except Exception as err:  # transformers raises many kinds for a directory without one
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(key, f"no tokenizer loads from {directory!r} ({detail}); allowed: a "
                               "local directory saved by save_pretrained") from None
    if not _encode(tokenizer, PLAIN_TEXT):
        missing = [f for f in TOKENIZER_FILES if not (Path(directory) / f).is_file()]
        why = f"no {' or '.join(missing)} there" if missing else "its files hold no vocabulary"
        raise ConfigError(key, f"the tokenizer of {directory!r} encodes a plain sentence as no "
                               f"tokens ({why}); allowed: a directory with the tokenizer saved "
                               "by save_pretrained")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(key, f"the tokenizer of {directory!r} has neither a pad nor an eos "
                                   "token; allowed: a tokenizer with an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _as_saved(tokenizer: Any, directory: Path) -> Any:
    """``tokenizer``, or the directory's ``tokenizer.json`` as saved (with the special tokens
    and chat template of its ``tokenizer_config.json``) where the two encode a plain sentence or
    the file's own first words differently. ``AutoTokenizer`` builds the class of the model type
    where the config names one (``Qwen2Tokenizer`` for a Qwen2 model), rebuilt from the file's
    vocabulary: a word-level vocabulary then encodes every word as nothing."""
    import tokenizers
    import transformers

    saved = directory / "tokenizer.json"
    if not saved.is_file():
        return tokenizer
    own = tokenizers.Tokenizer.from_file(str(saved))
    special = set(own.get_added_tokens_decoder())
    words = own.decode([i for i in range(min(own.get_vocab_size(), 64)) if i not in special][:8])
    if all(_encode(tokenizer, text) == own.encode(text, add_special_tokens=False).ids
           for text in (PLAIN_TEXT, words)):
        return tokenizer
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory),
                                                                local_files_only=True)


def actor_tokenizer(cfg: Config) -> Any:
    key = "actor.tokenizer" if cfg.actor.tokenizer else "actor.path"
    return load_tokenizer(tokenizer_dir(cfg), cfg.actor.trust_remote_code, key)


def rollout_tokenizer(cfg: Config) -> Any:
    """The tokenizer rollouts are made with (pad and eos ids): the actor's, or the task's when the
    actor is an inline config."""
    if tokenizer_dir(cfg) is None:
        from rlhf_paro.ppo.task import task_from_config

        return task_from_config(cfg).tokenizer
    return actor_tokenizer(cfg)


# Files by which a model directory carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def reward_tokenizer(cfg: Config, actor: Any = None) -> Any | None:
    """The reward model's own tokenizer when it differs from the actor's (rollouts are then
    decoded and encoded again), else None: the reward reads the actor's token ids. ``actor``:
    the actor's tokenizer where the caller has it loaded already."""
    reward = cfg.reward
    if reward.path is None or not reward.runs_model or tokenizer_dir(cfg) is None:
        return None
    if not any((Path(reward.path).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        return None  # a directory without a tokenizer is read with the actor's
    own = load_tokenizer(reward.path, reward.trust_remote_code, "reward.path")
    actor = actor if actor is not None else actor_tokenizer(cfg)
    return None if own.get_vocab() == actor.get_vocab() else own


def vocab_sizes(cfg: Config) -> dict[str, int]:
    """Token ids each model's embedding must hold: the actor tokenizer's (or the task's), except
    for a reward model that reads its own tokenizer's."""
    if tokenizer_dir(cfg) is None:
        from rlhf_paro.ppo.task import task_from_config

        actor, size = None, task_from_config(cfg).tokenizer.vocab_size
    else:
        actor = actor_tokenizer(cfg)
        size = len(actor)
    sizes = dict.fromkeys(ROLES, size)
    own = reward_tokenizer(cfg, actor)
    if own is not None:
        sizes["reward"] = len(own)
    return sizes


@dataclass
class PromptSet:
    """Tokenized prompts and the columns that travel with them."""

    ids: list[list[int]]  # token ids of each prompt, unpadded
    texts: list[str]  # each prompt as the model sees it (chat template applied)
    columns: dict[str, list[Any]] = field(default_factory=dict)  # the rows' other columns
    num_skipped: int = 0  # prompts longer than data.max_prompt_length or the models' context

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, index: list[int]) -> PromptSet:
        return PromptSet([self.ids[i] for i in index], [self.texts[i] for i in index],
                         {k: [v[i] for i in index] for k, v in self.columns.items()})


class _Table(NamedTuple):
    """One prompt file as read: its columns (every row has each, None where the file's row
    lacks it), its number of rows, and the rows, each with the number an error line names it
    by (``_rows``), to be read once."""

    columns: list[str]
    num_rows: int
    rows: Iterable[tuple[int, dict[str, Any]]]


def _read(files: list[str], key: str) -> list[tuple[str, _Table]]:
    """Each file with its table. The tables are not joined into one: the rows are checked one
    by one (``_tokenized``), and files whose columns have different types (a string prompt in
    one, chat messages in another) are as good as one file that mixes them."""
    tables = []
    for file in files:
        path = Path(file).expanduser()
        if path.stat().st_size == 0:
            raise ConfigError(key, f"{file!r} is empty; allowed: a file with at least one prompt")
        table = (_parquet(file, path, key) if file.endswith(".parquet") else
                 _json(file, path.read_bytes(), key))
        if table.num_rows == 0:
            raise ConfigError(key, f"{file!r} holds no rows; allowed: at least one prompt")
        tables.append((file, table))
    return tables


def _parquet(file: str, path: Path, key: str) -> _Table:
    """A .parquet file's table, read with the ``datasets`` library; its rows counted from 1."""
    import datasets

    datasets.disable_progress_bars()
    # datasets logs a file it cannot read as well as raising: the error line says it once.
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        part = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as err:  # the datasets library's and pyarrow's errors come in many types
        cause = err.__cause__ or err
        detail = one_line(str(cause)) or type(cause).__name__
        raise ConfigError(key, f"cannot read {file!r}: {detail}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)

    def rows() -> Iterator[tuple[int, dict[str, Any]]]:
        table = iter(part)
        for number in range(1, len(part) + 1):
            try:
                yield number, next(table)
            except UnicodeDecodeError:  # a binary column is decoded only as its row is read
                raise ConfigError(key, f"{file!r} row {number} is not UTF-8 text; allowed: UTF-8 "
                                       "files") from None

    return _Table(part.column_names, len(part), rows())


# JSON's whitespace: what may stand between values, and all a blank line of JSON lines holds.
_SPACE = re.compile(r"[ \t\n\r]*")
# What a .jsonl and a .json file may hold, as the error lines say it.
_ALLOWED = {".jsonl": "one JSON object on each line",
            ".json": "a JSON array of objects, or one JSON object on each line"}


class _RepeatedKey(Exception):
    """An object of a prompt file names a key twice (``json`` keeps the last one silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        raise _RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _json(file: str, data: bytes, key: str) -> _Table:
    """A .json or .jsonl file's table, read here rather than by a library, so that whatever is
    wrong with it is one line naming the file and the row: a .jsonl file is JSON lines (one
    object a line, blank lines aside; its rows are named by their lines), a .json file one
    array of objects (rows counted from 1), one object, or JSON lines."""
    data = data.removeprefix(codecs.BOM_UTF8)  # as an editor may save UTF-8
    allowed = _ALLOWED[".json" if file.endswith(".json") else ".jsonl"]
    rows = _json_whole(file, data, key, allowed) if file.endswith(".json") else None
    if rows is None:
        rows = _json_lines(file, data, key, allowed)
    # Rows that lack a column another has hold None there, as a table would.
    columns = list(dict.fromkeys(column for _, row in rows for column in row))
    return _Table(columns, len(rows), [(n, {c: row.get(c) for c in columns}) for n, row in rows])


@contextlib.contextmanager
def _json_errors(key: str, where: str, allowed: str) -> Iterator[None]:
    """What reading the JSON of ``where`` raises, as one line naming ``key`` and ``where``."""
    try:
        yield
    except _RepeatedKey as err:
        raise ConfigError(key, f"{where} has the key {err.key!r} twice in one object; allowed: "
                               "each key once") from None
    except json.JSONDecodeError as err:
        at = f"column {err.colno}" if err.lineno == 1 else f"line {err.lineno} column {err.colno}"
        raise ConfigError(key, f"{where} is not JSON ({err.msg} at {at}); allowed: {allowed}"
                          ) from None
    except (ValueError, RecursionError) as err:  # a number of too many digits, nesting too deep
        raise ConfigError(key, f"{where} cannot be read ({described(err)}); allowed: {allowed}"
                          ) from None


def _json_lines(file: str, data: bytes, key: str, allowed: str
                ) -> list[tuple[int, dict[str, Any]]]:
    """The rows of JSON lines, each named by its line."""
    rows = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip(b" \t\r"):
            continue  # a blank line holds no row, as the one a final newline leaves
        where = f"{file!r} row {number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(key, f"{where} is not UTF-8 text; allowed: UTF-8 files") from None
        with _json_errors(key, where, allowed):
            value = _DECODER.decode(text)
        rows.append((number, _object(value, where, key, allowed)))
    return rows


def _json_whole(file: str, data: bytes, key: str, allowed: str
                ) -> list[tuple[int, dict[str, Any]]] | None:
    """The rows of a .json file that is one JSON value (an array of objects, or one object);
    None for a file that is not, to be read as JSON lines."""
    array = data.lstrip(b" \t\n\r").startswith(b"[")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        if not array:
            return None  # JSON lines name the line that is not UTF-8
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(key, f"{file!r} line {line} is not UTF-8 text; allowed: UTF-8 files"
                          ) from None
    if not array:
        try:
            whole = json.loads(text)
        except (ValueError, RecursionError):
            return None  # more than one value: JSON lines, or a fault they name by its line
        if not isinstance(whole, dict):
            raise ConfigError(key, f"{file!r} is {_kind(whole)}; allowed: {allowed}")
        with _json_errors(key, f"{file!r} row 1", allowed):
            return [(1, _DECODER.decode(text))]
    with _json_errors(key, repr(file), allowed):
        json.loads(text)  # the array's syntax, so that what follows reads a valid one
    rows, line, seen = [], 1, 0
    pos = _SPACE.match(text, _SPACE.match(text).end() + 1).end()  # past the "["
    while text[pos] != "]":
        line, seen = line + text.count("\n", seen, pos), pos
        where = f"{file!r} row {len(rows) + 1} (line {line})"
        with _json_errors(key, where, allowed):
            value, pos = _DECODER.raw_decode(text, pos)
        rows.append((len(rows) + 1, _object(value, where, key, allowed)))
        pos = _SPACE.match(text, pos).end()
        if text[pos] == ",":
            pos = _SPACE.match(text, pos + 1).end()
    return rows


def _object(value: Any, where: str, key: str, allowed: str) -> dict[str, Any]:
    """``value`` if it is an object whose text is all valid Unicode: a ``\\udcff`` escape
    reads as a lone surrogate, which has no UTF-8 for the tokenizer or a reward server."""
    if not isinstance(value, dict):
        raise ConfigError(key, f"{where} is {_kind(value)}, not a JSON object; allowed: "
                               f"{allowed}")
    values = [value]
    while values:
        item = values.pop()
        if isinstance(item, dict):
            values += [*item, *item.values()]
        elif isinstance(item, list):
            values += item
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ConfigError(key, f"{where} holds text with {item[err.start]!r} at character "
                                       f"{err.start}, a lone surrogate; allowed: valid Unicode"
                                  ) from None
    return value


def _rows(tables: list[tuple[str, _Table]]) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row of each file: ``where`` names the file and the row there,
    counted from 1 (a .jsonl file's line)."""
    for file, table in tables:
        for number, row in table.rows:
            yield f"{file!r} row {number}", row


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({str(value)[:40]})"


def _messages(prompt: Any) -> list[dict[str, str]] | None:
    """``prompt`` as chat messages: a string is one user message; None if it is neither a
    string nor a list of ``{"role": str, "content": str}``."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        return None
    for message in prompt:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return None
    return prompt


def _tokenized(prompt: Any, where: str, data: Any, tokenizer: Any,
               tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """(text as the model sees it, token ids) of one row's prompt; ``ConfigError`` naming the
    row for anything else than a string or chat messages, or messages the template refuses.
    ``tools``: the schemas of ``env.tools``, which the chat template renders into the prompt."""
    key = data.prompt_key
    if not data.apply_chat_template:
        if isinstance(prompt, str):
            return prompt, tokenizer(prompt)["input_ids"]
        if _messages(prompt) is not None:
            raise ConfigError("data.prompt_key", f"{where}: {key!r} holds chat messages; "
                                                 "allowed: data.apply_chat_template=true")
        raise ConfigError("data.prompt_key", f"{where}: {key!r} is {_kind(prompt)}; allowed: "
                                             "a string, or chat messages with "
                                             "data.apply_chat_template=true")
    messages = _messages(prompt)
    if messages is None:
        raise ConfigError("data.prompt_key", f"{where}: {key!r} is {_kind(prompt)}; allowed: a "
                                             "string or a list of chat messages "
                                             '{"role": "...", "content": "..."}')
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as err:  # the template is the user's: jinja2 errors, raise_exception()
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError("data.apply_chat_template",
                          f"{where}: the chat template refuses its messages "
                          f"({type(err).__name__}{': ' + detail if detail else ''})") from None
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def first_row(cfg: Config) -> dict[str, Any]:
    """The first row of the first training file, as an environment is built from it
    (``NAME(**row)``: the prompt column as it is in the file, the other columns)."""
    (_, table), = _read(data_files(cfg.data.train_files)[:1], "data.train_files")
    return dict(next(iter(table.rows))[1])


def load_prompts(cfg: Config, tokenizer: Any, split: str = "train",
                 context: tuple[int, str] | None = None) -> PromptSet:
    """The prompts of ``data.train_files`` (or ``val_files``), tokenized; ``ConfigError`` for a
    missing column, messages without a chat template, an empty file or nothing short enough,
    and, naming the file and the row, text that is not UTF-8, a prompt that is neither a string
    nor chat messages (null, a number), or messages the chat template refuses.

    ``context``: (tokens, what) of the shortest context of the run's models
    (``resolve.context_limits``); a prompt of that many tokens or more leaves no room for a
    response and is skipped like one over ``data.max_prompt_length``."""
    data = cfg.data
    key = f"data.{split}_files"
    files = data_files(data.train_files if split == "train" else data.val_files)
    tables = _read(files, key)
    columns = tables[0][1].columns
    if data.prompt_key not in columns:
        raise ConfigError("data.prompt_key", f"no column {data.prompt_key!r} in {files[0]!r}"
                                             f"; allowed: {', '.join(columns)}")
    for file, table in tables[1:]:
        if sorted(table.columns) != sorted(columns):
            raise ConfigError(key, f"{file!r} has the columns {', '.join(table.columns)} "
                                   f"and {files[0]!r} {', '.join(columns)}; allowed: files "
                                   "with the same columns")
    if data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.apply_chat_template", "the actor's tokenizer has no chat "
                                                      "template; allowed: false")
    others = [c for c in columns if c != data.prompt_key]
    taken = [c for c in others if c in ARGUMENTS]
    if taken:
        raise ConfigError(key, f"{files[0]!r} has a column {taken[0]!r}, the name of a reward "
                               "function's own argument (name(prompts, responses, **columns)); "
                               f"allowed: columns named other than {', '.join(ARGUMENTS)}")
    out = PromptSet([], [], {c: [] for c in others})
    tools = None
    if cfg.env.tools is not None:
        from rlhf_paro.envs import tool_schemas

        tools = tool_schemas(cfg)
    longer = f"longer than data.max_prompt_length={data.max_prompt_length} tokens"
    filling = (f"of {context[0]} tokens or more ({context[1]}: no room for a response)"
               if context is not None else "")
    skipped: dict[str, list[str]] = {longer: [], filling: []}  # why -> where, in file order
    for where, row in _rows(tables):
        text, ids = _tokenized(row[data.prompt_key], where, data, tokenizer, tools)
        if len(ids) > data.max_prompt_length or context is not None and len(ids) >= context[0]:
            skipped[longer if len(ids) > data.max_prompt_length else filling].append(where)
            continue
        if not ids:
            raise ConfigError(key, f"{where}: an empty prompt")
        out.ids.append(ids)
        out.texts.append(text)
        for c in others:
            out.columns[c].append(row[c])
    out.num_skipped = sum(map(len, skipped.values()))
    reasons = [f"{len(rows)} {why} ({_first(rows)})" for why, rows in skipped.items() if rows]
    if out.num_skipped:
        num_rows = sum(table.num_rows for _, table in tables)
        print(f"[data] {key}: skipped {out.num_skipped} of {num_rows} prompts: "
              f"{'; '.join(reasons)}", flush=True)
    if not out.ids:
        raise ConfigError("data.max_prompt_length", f"every prompt of {', '.join(files)} is "
                                                    f"skipped: {'; '.join(reasons)}")
    return out


def _first(rows: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``rows`` (where each is), and how many more there are."""
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return ", ".join(rows[:shown]) + more


class PromptStream:
    """Batches of prompts in seeded epochs: epoch e is a permutation drawn from seed + e
    (``data.shuffle``) or the file order; a batch may run over into the next epoch."""

    def __init__(self, prompts: PromptSet, seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._order: list[int] = []

    @property
    def left(self) -> int:
        """Prompts of the current epoch not yet taken."""
        return len(self._order)

    def seek(self, epoch: int, left: int) -> None:
        """Stand where a stream stood with ``epoch`` epochs begun and ``left`` prompts of the
        last one untaken (a resumed run's prompts go on where the saved run's stopped)."""
        self.epoch = max(epoch - 1, 0)
        self._order = []
        if epoch:
            self._draw()
            self._order = self._order[len(self._order) - left:] if left else []

    def _draw(self) -> None:
        n = len(self.prompts)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self._order = (torch.randperm(n, generator=generator).tolist() if self.shuffle
                       else list(range(n)))
        self.epoch += 1

    def next(self, num: int) -> PromptSet:
        index: list[int] = []
        while len(index) < num:
            if not self._order:
                self._draw()
            take = num - len(index)
            index += self._order[:take]
            self._order = self._order[take:]
        return self.prompts.rows(index)


def left_pad(ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest), padding on the left."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        if row:
            input_ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return input_ids, mask
