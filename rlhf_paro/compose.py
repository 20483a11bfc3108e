"""Composition: conf files, the command line's overrides and interpolations, built into a ``Config``.

``load_config(["conf=ppo_tiny", "actor.strategy=IGG", ...])`` builds a ``Config`` in five steps:

1. read ``conf/ppo_tiny.yaml`` (``conf=NAME``) or a ``.yaml`` path, over the confs its
   ``defaults:`` list names, merged in order (mappings key by key, anything else replaces);
2. apply the overrides in order: ``key=value`` sets, ``+key=value`` adds a key to a model's
   inline ``config`` (the schema's own keys always exist), ``~key`` deletes (a schema key is then
   back at its default); values as typed (below). A key given replaces the keys the schema
   says compete with it (``_drop_competing``);
3. resolve OmegaConf interpolations: ``${ppo.rollout_batch_size}`` (a key the conf or the command
   line sets), ``${oc.env:NAME}``, and any an entry point registered (``register_resolver``);
4. build the dataclasses of ``rlhf_paro.config`` (the schema), checking every key and type;
5. expand a ``~`` that starts a path, once, for every key that names a file or directory
   (``config.PATH_KEYS``): ``trainer.output_dir=~/runs/x`` (a shell leaves a ``~`` after
   ``key=`` as typed) is the home's ``runs/x`` for the lock, the definition and the outputs
   alike; ``~user/...`` is that user's home, and one of no user here is refused.

Override values are read by one parser, which the sweep splitter (``split_sweep``) and the value
reader (``_parse_value``) share, so a value is a sweep for both or for neither:

- the value is everything after the key's first ``=``, as typed: ``=``, ``#``, ``~``, ``:``,
  spaces inside it, a quote inside a word (``it's``) and any unicode are its own characters;
- a value that starts with a quote is a quoted string (YAML's quoting: ``'it''s'``,
  ``"a \\" b"``) and ends with its closing quote; one that starts with ``[`` or ``{`` is a list or
  mapping in YAML's flow syntax (``[a, b]``, ``{a: 1}``), a ``#`` after a space there quoted;
- any other value is plain: a string key's (``logger.wandb.name``, ``trainer.output_dir``)
  is its text (``007``, ``1e-5``, ``yes`` and ``a #b`` stay text), another key's is read as a
  YAML scalar is in a conf file (``3``, ``1e-5``, ``true``, ``.inf``); ``null`` or nothing after
  the ``=`` is null for every key;
- commas outside a quoted string, a list, a mapping and ``${...}`` separate the values of a
  sweep (``-m``; without it a sweep is refused), but those of a file list (``data.train_files``)
  and of ``env.tools=file.py:a,b`` are the value's own;
- refused in one line naming the key: a space at the start or end of a plain value (quote it
  to keep one), an unclosed quote or bracket, text after a closing one, a control character.

Nothing here reads a file but the confs or makes anything; what the config names is checked,
and what it leaves to be derived is set, by ``rlhf_paro.resolve`` afterwards. Like the schema,
this module imports neither torch nor anything above the config.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os
import re
import types
import typing
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, UnsupportedValueType

from rlhf_paro.config import (
    FILE_LIST_KEYS, ROLES, Config, ConfigError, ModelConfig, _field_names, _join, _optional,
    _unknown_key, build_config, map_paths,
)

# conf/ sits next to the package in the repository (and in an editable install).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEFAULT_CONF = "ppo_tiny"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # Read for every key of every conf and override: evaluating the annotations each time was
    # half of composing a command line.
    return typing.get_type_hints(cls)


def _schema_depth(parts: list[str]) -> int:
    """How many leading parts of a dotted key are keys of the schema; any after them lie inside
    a model's inline ``config`` (a mapping the schema leaves open). Raises ``ConfigError`` for a
    key the schema does not have."""
    node: Any = Config
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        if not dataclasses.is_dataclass(node):
            raise ConfigError(prefix, f"is a value, not a section, so it has no key {part!r}")
        names = _field_names(node)
        if part not in names:
            raise _unknown_key(node, prefix, part)
        node = _optional(_hints(node)[part])
        if typing.get_origin(node) is dict:
            return depth + 1
    return len(parts)


# --- conf files and the command line --------------------------------------------------------------

class _YamlLoader(yaml.SafeLoader):
    """YAML as OmegaConf reads it, for conf files and override values alike: ``1e-5`` is a
    number (YAML 1.1 reads it as a string) and a date stays a string."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# The ConfigError a registered resolver raised, which OmegaConf reports wrapped in several lines.
_RESOLVER_ERROR: contextvars.ContextVar[ConfigError | None] = contextvars.ContextVar(
    "rlhf_paro_resolver_error", default=None)


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """Make ``${name:...}`` call ``resolver`` (as OmegaConf calls it, ``_root_`` included) in
    the confs and overrides composed from now on; a ``ConfigError`` it raises stays one line.
    Composition registers none: the entry points register theirs (``${demo:NAME}``,
    ``ppo/demo.py``). Registering the same name again keeps the first."""
    if OmegaConf.has_resolver(name):
        return

    @functools.wraps(resolver)
    def reporting(*args: Any, **kwargs: Any) -> Any:
        try:
            return resolver(*args, **kwargs)
        except ConfigError as err:
            _RESOLVER_ERROR.set(err)
            raise

    # OmegaConf 2.4 moved this to register_resolver (2.3 has an older call of that name) and
    # warns on the old one; a warning would break our one-line errors on stderr.
    if "annotation_validation" in inspect.signature(OmegaConf.register_resolver).parameters:
        OmegaConf.register_resolver(name, reporting, annotation_validation="off")
    else:
        OmegaConf.register_new_resolver(name, reporting)


@contextlib.contextmanager
def _omegaconf_errors() -> Iterator[None]:
    """OmegaConf's errors (a bad interpolation, a value it cannot hold) as one-line errors."""
    try:
        yield
    except OmegaConfBaseException as err:
        failed = _RESOLVER_ERROR.get()
        if failed is not None:  # a resolver's own one-line error, which OmegaConf wraps
            _RESOLVER_ERROR.set(None)
            raise failed from None
        # The first line is the problem; OmegaConf adds the key and the object type below it.
        problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        allowed = ("numbers, strings, booleans, null, lists and mappings"
                   if isinstance(err, UnsupportedValueType) else
                   "${key} of a key the conf or the command line sets, ${oc.env:NAME}, "
                   "or \\${ for a literal ${")
        raise ConfigError(getattr(err, "full_key", None) or "", f"{problem}; allowed: "
                                                                  f"{allowed}") from None


def conf_path(name: str) -> Path:
    """``conf=NAME`` -> ``conf/NAME.yaml``; a value ending in .yaml/.yml is a path."""
    if name.endswith((".yaml", ".yml")):
        return Path(_home("conf", name))
    return CONF_DIR / f"{name}.yaml"


def _home(key: str, path: str) -> str:
    """``path`` with the ``~`` or ``~user`` that starts it expanded, as a shell expands one
    before a path (it leaves the one after ``key=`` as typed); ``ConfigError`` naming ``key``
    for ``~user`` of a user this machine does not have."""
    if not path.startswith("~"):
        return path
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise ConfigError(key, f"{path!r} starts with {path.partition('/')[0]}, the home of no "
                               "user here; allowed: ~/PATH, ~USER/PATH of a user of this "
                               "machine, or a path without a leading ~")
    return expanded


def available_confs() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def _read_conf(path: Path, chain: tuple[Path, ...] = ()) -> DictConfig:
    """The conf at ``path`` over the confs of its ``defaults`` list, merged in order."""
    if not path.is_file():
        allowed = ", ".join(available_confs()) or "none found"
        name = path.stem if path.parent == CONF_DIR else str(path)
        raise ConfigError("conf", f"no conf {name!r}; allowed: a .yaml path or one of {allowed}")
    if path.resolve() in chain:
        raise ConfigError("defaults", f"{path.name} includes itself through its defaults")
    try:
        data = yaml.load(path.read_text(), Loader=_YamlLoader) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError("conf", f"{path.name}{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("conf", f"{path.name} must be a mapping of sections")
    defaults = data.pop("defaults", []) or []
    if not isinstance(defaults, list):
        raise ConfigError("defaults", f"expected a list of conf names, got {defaults!r}")
    with _omegaconf_errors():
        merged = OmegaConf.create()
        for name in defaults:
            sibling = path.parent / f"{name}.yaml"
            base = sibling if sibling.is_file() else conf_path(str(name))
            merged = OmegaConf.merge(merged, _read_conf(base, chain + (path.resolve(),)))
        # A conf's keys replace its defaults' competing keys, as the command line's do.
        _drop_competing(merged, set(_dotted_keys(data)))
        return OmegaConf.merge(merged, OmegaConf.create(data))


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of nested mappings, dotted (``actor``, ``actor.path``, ...)."""
    for key, value in data.items():
        dotted = _join(prefix, str(key))
        yield dotted
        if isinstance(value, dict):
            yield from _dotted_keys(value, dotted)


class Override(NamedTuple):
    """One command-line override: ``key=value`` (op ``=``), ``+key=value`` or ``~key``."""

    op: Literal["=", "+", "~"]
    key: str
    value: Any  # read by ``_parse_value``; None for ``~``


# --- override values (the module docstring's rule) -----------------------------------------------

_QUOTES = "'\""
_OPENS, _CLOSES = "[{", "]}"
# What a plain value of a string key reads as null (YAML's nulls but ``~``, which starts a path).
_TEXT_NULLS = ("", "null", "Null", "NULL")
# A plain value of another key is typed as a YAML scalar in a conf file is, and nothing more:
# no comment, no ``key: value`` mapping, no tag.
_SCALARS = _YamlLoader("")


def _closing_quote(key: str, text: str, start: int) -> int:
    """The index after the quoted string that opens at ``text[start]``: YAML's quoting, ``''``
    a quote inside single quotes, a backslash escaping inside double ones."""
    quote, i = text[start], start + 1
    while i < len(text):
        if quote == '"' and text[i] == "\\":
            i += 2
        elif text[i] == quote and not (quote == "'" and text[i + 1:i + 2] == "'"):
            return i + 1
        else:
            i += 2 if text[i] == quote else 1
    raise ConfigError(key, f"{text[start:]!r} opens a quote it never closes; allowed: a quoted "
                           f"string closed by its quote, or a quote inside a word (it's)")


def _flow_end(key: str, text: str, start: int) -> int:
    """The index after the list or mapping that opens at ``text[start]``. A quote opens a string
    only where an item starts, as in YAML (``[it's]`` holds the word it's); a ``#`` after a space
    would start a YAML comment and swallow the rest, so it is refused."""
    depth, last, i = 0, text[start], start
    while i < len(text):
        char = text[i]
        if char in _QUOTES and last in ",:[{":
            i = _closing_quote(key, text, i)
            last = char
            continue
        if char == "#" and text[i - 1].isspace():
            raise ConfigError(key, f"{text[start:]!r}: a # after a space inside [ ] or {{ }} "
                                   "starts a YAML comment; allowed: the item quoted ('a #b')")
        depth += (char in _OPENS) - (char in _CLOSES)
        if depth == 0:
            return i + 1
        last = last if char.isspace() else char
        i += 1
    raise ConfigError(key, f"{text[start:]!r} opens a {text[start]} it never closes; allowed: "
                           f"a closed list [a, b] or mapping {{a: 1}}, or the text quoted")


def _item_end(key: str, text: str, start: int, commas: bool) -> int:
    """Where the value that starts at ``text[start]`` ends: after its closing quote or bracket,
    or for a plain value at the first comma outside ``${...}`` (with ``commas``) or the end."""
    first = text[start:start + 1]
    if first and first in _QUOTES:
        end = _closing_quote(key, text, start)
    elif first and first in _OPENS:
        end = _flow_end(key, text, start)
    else:
        depth = 0  # inside ${...}, whose resolver arguments have commas of their own
        for i in range(start, len(text)):
            char = text[i]
            if char == "{" and (depth or text[i - 1:i] == "$"):
                depth += 1
            elif char == "}" and depth:
                depth -= 1
            elif char == "," and commas and not depth:
                return i
        return len(text)
    if end < len(text) and not (commas and text[end] == ","):
        raise ConfigError(key, f"{text[start:]!r} goes on after its closing {text[end - 1]}; "
                               f"allowed: a quoted string, list or mapping alone, or the whole "
                               f"text quoted: {quoted(text[start:])}")
    return end


def split_sweep(key: str, text: str) -> list[str]:
    """The values of a sweep ``a,b,c``, each as typed: the text cut at commas outside quoted
    strings, lists, mappings and ``${...}`` (``[a, b]``, ``{a: 1, b: 2}``, ``'a,b'`` and
    ``${oc.env:A,b}`` are one value each; so is ``it's``, whose quote is inside a word)."""
    values, start = [], 0
    while True:
        end = _item_end(key, text, start, commas=True)
        values.append(text[start:end])
        if end == len(text):
            return values
        start = end + 1


def quoted(text: str) -> str:
    """``text`` as an override's value that parses back to ``text`` itself: a YAML single-quoted
    string, which no comma sweeps (``split_sweep``) and no ``1e-5`` or ``null`` turns into
    another type."""
    return "'" + text.replace("'", "''") + "'"


def sweep_values(key: str, text: str) -> list[str]:
    """The values that ``key=text`` sweeps over (one: no sweep). A file list's commas are its
    own; so are those of ``env.tools=file.py:a,b``, where a value without a ``:`` is one more
    function of the file before it (``a.py:f,g,b.py:h`` sweeps over two sets of tools)."""
    if key in FILE_LIST_KEYS:
        return [text]
    values = split_sweep(key, text)
    if key != "env.tools":
        return values
    joined: list[str] = []
    for value in values:
        if joined and ":" not in value:
            joined[-1] += "," + value
        else:
            joined.append(value)
    return joined


def parse_overrides(argv: list[str]) -> tuple[str, list[Override]]:
    """``conf=NAME`` and the overrides of a command line -> (conf name, overrides in order)."""
    conf = DEFAULT_CONF
    overrides = []
    for arg in argv:
        op = arg[0] if arg[:1] in ("+", "~") else "="
        key, sep, text = (arg if op == "=" else arg[1:]).partition("=")
        key = key.strip()
        if (not sep and op != "~") or not key or any(not part for part in key.split(".")):
            raise ConfigError(arg, "expected key=value with a dotted key, e.g. "
                                   "actor.strategy=IGG, +key=value, ~key or conf=ppo_tiny")
        if op == "~" and sep:
            raise ConfigError(key, f"~{key} deletes the key and takes no value; allowed: ~{key}")
        if key == "conf":
            if op != "=":
                raise ConfigError(key, "selects the conf; allowed: conf=NAME or conf=path.yaml")
            conf = text.strip()
            continue
        if op != "~" and len(sweep_values(key, text)) > 1:
            raise ConfigError(key, f"{text!r} is a sweep; allowed: -m to run one job per value, "
                                   f"a list [{text}], or a quoted string {quoted(text)}")
        overrides.append(Override(op, key, None if op == "~" else _parse_value(key, text)))
    return conf, overrides


def _parse_value(key: str, text: str) -> Any:
    """One value of ``key=text`` (a whole value, or one of a sweep's), by the module docstring's
    rule."""
    bad = next((c for c in text if unicodedata.category(c) in ("Cc", "Cs")), None)
    if bad is not None:
        raise ConfigError(key, f"{text!r} holds {ascii(bad)}, a control character or a byte "
                               "that is not UTF-8; allowed: printable text")
    _item_end(key, text, 0, commas=False)  # a quoted string, list or mapping is the whole text
    if text[:1] and text[:1] in _QUOTES + _OPENS:
        try:
            return yaml.load(text, Loader=_YamlLoader)
        except yaml.YAMLError:
            raise ConfigError(key, f"cannot parse {text!r} as a value; allowed: a quoted string "
                                   "'a b', a list [a, b] or a mapping {a: 1} in YAML") from None
    if text != text.strip():
        raise ConfigError(key, f"{text!r} starts or ends with a space; allowed: the value "
                               f"without it, or quoted to keep it: {quoted(text)}")
    if _is_text(key):
        return None if text in _TEXT_NULLS else text
    tag = _SCALARS.resolve(yaml.ScalarNode, text, (True, False))
    try:
        return _SCALARS.construct_object(yaml.ScalarNode(tag, text))
    except ValueError:  # YAML's pattern of a number that is none (0b_)
        raise ConfigError(key, f"cannot parse {text!r} as a value; allowed: a number such as 3 "
                               "or 1e-5, true, false, null or text") from None


def _is_text(key: str) -> bool:
    """Whether the schema types the dotted ``key`` as a string (``str`` or ``str | None``)."""
    node: Any = Config
    for part in key.split("."):
        if not (dataclasses.is_dataclass(node) and part in _field_names(node)):
            return False  # inside a model's inline config, or a key _apply reports
        node = _hints(node)[part]
    return node is str or (typing.get_origin(node) in (typing.Union, types.UnionType)
                           and str in typing.get_args(node))


def _apply(cfg: DictConfig, override: Override) -> None:
    """Set, add or delete one key of the composed conf (see the module docstring)."""
    op, key = override.op, override.key
    parts = key.split(".")
    depth = _schema_depth(parts)
    if op == "+" and depth == len(parts):
        raise ConfigError(key, f"is a key of the schema, which always has it; allowed: "
                               f"{key}=VALUE (+ adds keys inside a model's inline config)")
    node = cfg
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            if op == "~":
                break
            node[part] = {}
        elif not isinstance(child, DictConfig):
            raise ConfigError(".".join(parts[:i + 1]), f"is {child!r}, not a section, so it has "
                                                       f"no key {parts[i + 1]!r}")
        node = node[part]
    else:
        last = parts[-1]
        if op == "~":
            if last in node:
                del node[last]
                return
        elif op == "+" and last in node:
            raise ConfigError(key, f"is already set to {node[last]!r}; allowed: {key}=VALUE to "
                                   "change it")
        else:
            node[last] = override.value
            return
    # A schema key that is not set has its default already; an inline-config key is just absent.
    if op == "~" and depth < len(parts):
        raise ConfigError(key, "is not set, so there is nothing to delete")


def _competing() -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(key -> the keys it replaces, key -> the keys that go when it is replaced), as the schema
    declares them: each model's ``SOURCES`` replace one another, and ``Config.REPLACES`` and
    ``Config.GOES_WITH`` name the rules across sections."""
    replaces = dict(Config.REPLACES)
    for role in ROLES:
        sources = [f"{role}.{key}" for key in ModelConfig.SOURCES]
        replaces.update({key: tuple(other for other in sources if other != key)
                         for key in sources})
    return replaces, dict(Config.GOES_WITH)


def _mapping_of(key: str) -> str:
    """``key``, or the open mapping of the schema it lies inside (``actor.config.hidden_size``
    -> ``actor.config``). A key the schema lacks is returned as it is: ``_apply`` reports it."""
    parts = key.split(".")
    try:
        return ".".join(parts[:_schema_depth(parts)])
    except ConfigError:
        return key


def _drop_competing(cfg: DictConfig, given: set[str]) -> None:
    """A key given on the command line replaces the conf's keys that compete with it (unless
    those are given too), so that a user's few keys are enough whatever the conf holds: a
    model's ``path`` drops its inline ``config``, and ``data.train_files`` the conf's
    validation files and score (``_competing``)."""
    replaces, goes_with = _competing()
    # A key inside a model's inline config (actor.config.hidden_size) gives that config too.
    given = given | {_mapping_of(key) for key in given}
    pending = [other for key in given for other in replaces.get(key, ())]
    while pending:
        other = pending.pop()
        section, _, name = other.partition(".")
        node = cfg.get(section)
        if other not in given and isinstance(node, DictConfig) and name in node:
            del node[name]
            pending += goes_with.get(other, ())


def compose(conf: str, overrides: list[Override]) -> dict[str, Any]:
    """The conf with the overrides applied and interpolations resolved, as plain data."""
    cfg = _read_conf(conf_path(conf))
    with _omegaconf_errors():
        _drop_competing(cfg, {override.key for override in overrides if override.op != "~"})
        for override in overrides:
            _apply(cfg, override)
        return OmegaConf.to_container(cfg, resolve=True)


def load_config(argv: list[str]) -> Config:
    """The ``Config`` of a command line: ``[conf=NAME|conf=path.yaml] [override ...]``, composed
    and built, a ``~`` that starts a path expanded; nothing is read but the confs, nothing is made
    (``resolve`` comes next)."""
    return map_paths(build_config(compose(*parse_overrides(argv))), _home)
