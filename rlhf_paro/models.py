"""The four PPO models as plain ``nn.Module``s over Hugging Face backbones.

actor, ref  ``CausalLM``: forward(input_ids, attention_mask, response_len) -> (B, R) log-probs of
            the last R tokens (or (B, T, V) logits without ``response_len``)
critic      ``ValueModel(per_token=True)``: -> (B, R) value of the state before each response token
reward      ``ValueModel(per_token=False)``: -> (B,) score at the last valid token

The Hugging Face model stays a submodule, so the sharding engine finds its blocks (the classes in
``_no_split_modules``, e.g. ``LlamaDecoderLayer``) and wraps each one as a unit. A model comes from
a local directory (``path``; never downloaded) or from an inline config (random init, seeded, so
actor and ref built with the same seed start from the same weights). ``meta=True`` builds on the
meta device: parameter counts and unit sizes without allocating a byte, for the planner.
``build_for_setup`` is what a worker shards: a model read from a directory comes with its
parameters on the meta device and a reader of its files (``weights.py``), so that no rank ever
holds it whole (docs/design.md, "Setup").
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from rlhf_paro import batching, weights
from rlhf_paro.config import FROZEN_ROLES, ROLES, Config, ConfigError, ModelConfig, coerce
from rlhf_paro.sharding import TensorFiles

VALUE_HEAD_FILE = "value_head.safetensors"
# Sizes and counts of a Hugging Face config (its names for them); below 1 they build no model.
_SIZE_KEY = re.compile(r"^num_|_size$|_dim$|^max_position_embeddings$")
# Dropout probabilities of a Hugging Face config (attention_dropout, hidden_dropout_prob,
# resid_pdrop, embd_pdrop, summary_first_dropout, layerdrop, ...) and the modules' copies of them.
_DROPOUT_KEY = re.compile(r"dropout|pdrop|layerdrop")


def _transformers():
    # Imported on first use: it takes seconds, and config errors should not wait for it.
    import transformers

    return transformers


def _rejected(key: str, what: str, err: Exception) -> ConfigError:
    # transformers rejects a bad value with many kinds of error (TypeError, ValueError,
    # AttributeError, KeyError, its strict-dataclass errors, whose cause says what was wrong):
    # whichever it is, the inline config the user wrote is at fault.
    cause = err.__cause__ or err
    detail = str(cause).splitlines()[0] if str(cause) else ""
    return ConfigError(key, f"{what}: {type(cause).__name__}: {detail}; allowed: the values "
                            "transformers accepts for it")


def hf_config(role: str, model_cfg: ModelConfig, vocab_size: int) -> Any:
    """The Hugging Face config of a model section; inline keys and the types of their values
    are checked against its class (older transformers releases check neither).

    ``vocab_size`` is the task tokenizer's: an inline config without one gets it, and a model
    whose vocabulary is smaller cannot embed the task's tokens.
    """
    if model_cfg.path is None and model_cfg.config is None:
        # A config not resolved: never fall back to a default-sized model.
        raise ValueError(f"{role} has no model source (path or config); resolve the config "
                         "first (rlhf_paro.resolve)")
    transformers = _transformers()
    if model_cfg.path is not None:
        key = f"{role}.path"
        try:
            config = transformers.AutoConfig.from_pretrained(
                model_cfg.path, local_files_only=True,
                trust_remote_code=model_cfg.trust_remote_code)
        except Exception as err:  # a directory that is not a model fails in many ways
            raise _rejected(key, f"{model_cfg.path!r} is not a Hugging Face model directory "
                                 f"(or its code needs {role}.trust_remote_code=true)", err) from None
    else:
        options = dict(model_cfg.config or {})
        model_type = options.pop("model_type", "llama")
        mapping = transformers.CONFIG_MAPPING
        if not isinstance(model_type, str) or model_type not in mapping:
            close = difflib.get_close_matches(str(model_type), list(mapping.keys()), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{role}.config.model_type", f"unknown model type {model_type!r}"
                              f"{hint}; allowed: a Hugging Face model type such as llama")
        config_class = mapping[model_type]
        defaults = config_class().to_dict()
        for name, value in options.items():
            key = f"{role}.config.{name}"
            if name not in defaults:
                close = difflib.get_close_matches(str(name), sorted(defaults), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(key, f"unknown key{hint}; allowed: the fields of "
                                       f"{config_class.__name__}")
            default = defaults[name]
            # A value of the default's type; None and the other types are transformers' to check.
            if value is None or not isinstance(default, (bool, int, float, str)):
                continue
            coerce(type(default), value, key)
            least = 1 if _SIZE_KEY.search(name) else 0
            if type(default) is int and value < least:
                raise ConfigError(key, f"got {value}; allowed: an integer >= {least}")
        options.setdefault("vocab_size", vocab_size)
        try:
            config = config_class(**options)
        except Exception as err:
            raise _rejected(f"{role}.config", f"rejected by {config_class.__name__}", err) from None
        key = f"{role}.config.vocab_size"
    if config.vocab_size < vocab_size:
        raise ConfigError(key, f"vocabulary of {config.vocab_size} is smaller than the task "
                               f"tokenizer's {vocab_size}; allowed: at least {vocab_size}")
    return config


def max_positions(config: Any) -> int | None:
    """The most positions a model of the Hugging Face ``config`` takes: its (text config's)
    ``max_position_embeddings``, GPT-2's ``n_positions`` under that name; None without one."""
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_model_configs(cfg: Config, vocab_sizes: dict[str, int]) -> None:
    """Raise ``ConfigError`` for a model section of any role that transformers rejects (run it
    before anything is written). Each distinct inline config is also built on the meta device
    (no memory, a fraction of a second): some values, an unknown activation for one, only fail
    there."""
    built: list[dict[str, Any]] = []
    for role in ROLES:
        model_cfg = cfg.model(role)
        # A reward function or server, or a critic a critic-free algorithm never builds.
        if not model_cfg.runs_model or (model_cfg.path is None and model_cfg.config is None):
            continue
        config = hf_config(role, model_cfg, vocab_sizes[role])
        if model_cfg.packing and not packs(model_cfg, config.model_type):
            raise ConfigError(f"{role}.packing", f"model type {config.model_type!r} does not "
                              "read packed sequences; allowed: false, or null (packed where "
                              f"supported: {', '.join(batching.PACKED_MODEL_TYPES)})")
        if role == "reward" and model_cfg.path is not None:
            check_reward_directory(model_cfg.path, config)
        if model_cfg.config is None or model_cfg.config in built:
            continue
        built.append(model_cfg.config)
        try:
            with torch.device("meta"):
                _transformers().AutoModelForCausalLM.from_config(config)
        except Exception as err:
            raise _rejected(f"{role}.config", "no model can be built from it", err) from None


def dropout_off(config: Any) -> dict[str, float]:
    """Set every dropout probability of the Hugging Face ``config`` (and of its text config, in a
    model that has one) to 0, before a model is built from it: some modules copy them when built,
    others read the config at each forward. Returns the values given, to write back on export."""
    given = {}
    text = config.get_text_config()
    for prefix, part in (("", config), ("text_config.", text)):
        if prefix and text is config:
            continue
        for name, value in part.to_dict().items():
            if _DROPOUT_KEY.search(name) and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and value != 0:
                given[prefix + name] = value
                setattr(part, name, 0.0)
    return given


def _dropout_modules_off(module: nn.Module) -> None:
    """Every dropout module of ``module`` at p = 0, and every dropout probability a module keeps
    as a number of its own (a value set in code, not from the config)."""
    for sub in module.modules():
        if isinstance(sub, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                            nn.AlphaDropout, nn.FeatureAlphaDropout)):
            sub.p = 0.0
            continue
        for name, value in vars(sub).items():
            if _DROPOUT_KEY.search(name) and isinstance(value, float):
                setattr(sub, name, 0.0)


@contextlib.contextmanager
def _given_dropout(model: nn.Module, given: dict[str, float]) -> Iterator[None]:
    """The Hugging Face config of ``model`` (a ``CausalLM`` or ``ValueModel``) with the dropout
    probabilities the user gave (``dropout_off``) while inside: an export writes the model's
    config as it came, not as the run trained it."""
    if not given:
        yield
        return
    config = (model.lm if isinstance(model, CausalLM) else model.backbone).config
    text = config.get_text_config()
    parts = [(text if name.startswith("text_config.") else config,
              name.removeprefix("text_config."), value) for name, value in given.items()]
    for part, name, value in parts:
        setattr(part, name, value)
    try:
        yield
    finally:
        for part, name, _ in parts:
            setattr(part, name, 0.0)


def packs(model_cfg: ModelConfig, model_type: str) -> bool:
    """Whether the model runs its forwards packed: ``packing``, where null means wherever its
    architecture reads packed sequences (``batching.PACKED_MODEL_TYPES``)."""
    if model_cfg.packing is False:
        return False
    return model_type in batching.PACKED_MODEL_TYPES


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each column's position: positions count valid tokens only, so a left-padded prompt sees
    the same positions as an unpadded one (what Hugging Face generation and the hf engine's
    decoding do too)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class CausalLM(nn.Module):
    """A causal LM whose forward returns a tensor: logits, or log-probs of the response tokens."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm  # Hugging Face *ForCausalLM, or a PEFT model around one
        # Dropout probabilities of the config as given, which ``dropout_off`` set to 0.
        self.given_dropout: dict[str, float] = {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_len: int | None = None, temperature: float = 1.0,
                packed: bool = False) -> torch.Tensor:
        """(B, T) tokens -> (B, response_len) float32 log-probs of the last ``response_len`` tokens
        under ``softmax(logits / temperature)``, or (B, T, V) logits if ``response_len`` is None.
        ``packed``: the model runs on the real tokens only (``batching``); the log-probs come
        back in the same layout, 0 where the response is padding."""
        if packed and response_len is not None:
            return self._packed_logprobs(input_ids, attention_mask, response_len, temperature)
        positions = position_ids(attention_mask)
        if response_len is None:
            return self.lm(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=positions, use_cache=False).logits
        # Logits at position t predict token t + 1: keep the R + 1 last positions, drop the final.
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=positions, use_cache=False,
                         logits_to_keep=response_len + 1).logits[:, :-1]
        logits = logits.float() / temperature
        targets = input_ids[:, -response_len:]
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return picked - logits.logsumexp(-1)

    def _packed_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         response_len: int, temperature: float) -> torch.Tensor:
        rows = batching.pack(input_ids, attention_mask)
        index, row, col = batching.response_predictors(rows, response_len)
        width = rows.input_ids.shape[1]
        here, there = rows.slots[index], rows.slots[index + 1]
        # The LM head runs only at the columns where some row predicts a response token.
        keep = torch.unique(here % width)
        logits = self.lm(input_ids=rows.input_ids, position_ids=rows.position_ids,
                         use_cache=False, logits_to_keep=keep).logits
        logits = logits[here // width, torch.searchsorted(keep, here % width)].float()
        logits = logits / temperature
        targets = rows.input_ids.reshape(-1)[there]
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        out = logits.new_zeros(input_ids.shape[0], response_len)
        out[row, col] = picked - logits.logsumexp(-1)
        return out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        """Hugging Face sampling; returns prompt + response tokens (B, T_prompt + T_response)."""
        return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class ValueModel(nn.Module):
    """A backbone with a scalar head: per-token values (critic) or a sequence score (reward)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, per_token: bool) -> None:
        super().__init__()
        self.backbone = backbone  # Hugging Face base model (no LM head), or a PEFT model
        self.value_head = nn.Linear(hidden_size, 1)
        self.per_token = per_token
        # Dropout probabilities of the config as given, which ``dropout_off`` set to 0.
        self.given_dropout: dict[str, float] = {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_len: int | None = None, packed: bool = False) -> torch.Tensor:
        """Critic: (B, response_len) values of the states before each of the last
        ``response_len`` tokens ((B, T) without it). Reward: (B,) score at the last valid token.
        ``packed``: the model runs on the real tokens only (``batching``); per-token values come
        back in the same layout, 0 at padding."""
        if packed:
            return self._packed_values(input_ids, attention_mask, response_len)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids(attention_mask),
                               use_cache=False).last_hidden_state
        values = self.value_head(hidden).squeeze(-1).float()
        if self.per_token:
            return values if response_len is None else values[:, -response_len - 1:-1]
        positions = torch.arange(values.shape[1], device=values.device)
        last = (attention_mask.long() * positions).argmax(-1)
        return values[torch.arange(values.shape[0], device=values.device), last]

    def _packed_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       response_len: int | None) -> torch.Tensor:
        rows = batching.pack(input_ids, attention_mask)
        hidden = self.backbone(input_ids=rows.input_ids, position_ids=rows.position_ids,
                               use_cache=False).last_hidden_state
        values = self.value_head(hidden).squeeze(-1).float()
        if not self.per_token:
            return values.reshape(-1)[rows.slots[batching.last_tokens(rows)]]
        values = batching.unpack(values, rows)
        return values if response_len is None else values[:, -response_len - 1:-1]


def _with_lora(module: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    import peft

    lora = model_cfg.lora
    return peft.get_peft_model(module, peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules)))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device as they register them, and
    make their buffers (rotary tables) for real, as a whole build does. It patches
    ``nn.Module``: one thread at a time."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a tied weight is registered on meta
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _backbone(role: str, model_cfg: ModelConfig, config: Any, auto_class: Any,
              meta: bool, lazy: bool = False) -> nn.Module:
    """The Hugging Face module of a section (weights from ``path`` or fresh), with checkpointing
    and LoRA as configured. Call under a seeded RNG: fresh weights come from it. ``lazy``: a
    ``path``'s module with its parameters on the meta device, for ``build_for_setup``."""
    device = "meta" if meta else "cpu"
    if meta or model_cfg.path is None:
        with torch.device(device):
            module = auto_class.from_config(config)
    elif lazy:
        with _parameters_on_meta():
            module = auto_class.from_config(config, dtype=torch.float32,
                                            trust_remote_code=model_cfg.trust_remote_code)
        module.eval()  # as from_pretrained leaves it (dropout off)
    else:
        # A backbone read out of a classifier or a causal LM leaves their heads unread: that is
        # meant, so transformers' load report is not shown.
        _transformers().utils.logging.set_verbosity_error()
        try:
            module = auto_class.from_pretrained(model_cfg.path, config=config,
                                                local_files_only=True, dtype=torch.float32,
                                                trust_remote_code=model_cfg.trust_remote_code)
        except MemoryError:
            raise
        except Exception as err:  # missing, cut or mismatched weights: the directory's fault
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ConfigError(f"{role}.path", f"cannot load the weights in {model_cfg.path!r} "
                              f"({type(err).__name__}: {detail}); allowed: a directory saved "
                              "by save_pretrained") from None
    if model_cfg.disable_dropout:  # before LoRA: its own dropout is the user's choice
        _dropout_modules_off(module)
    if model_cfg.gradient_checkpointing and not meta:
        module.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_cfg.lora.enabled:
        with torch.device(device), _parameters_on_meta() if lazy else contextlib.nullcontext():
            module = _with_lora(module, model_cfg)
    return module


def build_causal_lm(model_cfg: ModelConfig, vocab_size: int, *, role: str = "actor",
                    seed: int = 0, meta: bool = False, lazy: bool = False) -> CausalLM:
    """Actor or ref: a Hugging Face causal LM (LoRA on top if enabled), without dropout
    unless ``disable_dropout=false``."""
    config = hf_config(role, model_cfg, vocab_size)
    given = dropout_off(config) if model_cfg.disable_dropout else {}
    transformers = _transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = _backbone(role, model_cfg, config, transformers.AutoModelForCausalLM, meta, lazy)
    model = CausalLM(lm)
    model.given_dropout = given
    if model_cfg.path is not None and not (meta or lazy):
        weights.start_fresh(model, seed)  # LoRA adapters ([Note: fresh parameters])
    return model


def build_value_model(model_cfg: ModelConfig, vocab_size: int, *, role: str = "critic",
                      per_token: bool = True, seed: int = 0, meta: bool = False,
                      lazy: bool = False) -> ValueModel:
    """Critic (per token) or reward (per sequence): the backbone of a causal LM + a scalar head.

    From a ``path``, a value head saved next to the weights (``save_value_model``) is loaded;
    without one the head starts fresh, which only makes sense for a critic.
    """
    config = hf_config(role, model_cfg, vocab_size)
    given = dropout_off(config) if model_cfg.disable_dropout else {}
    transformers = _transformers()
    head = None if model_cfg.path is None or meta else saved_head(model_cfg.path)
    if not per_token and model_cfg.path is not None and not meta and head is None:
        raise ConfigError(f"{role}.path", f"{model_cfg.path!r} has no score head; allowed: a "
                          "Hugging Face sequence-classification model with one label")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = _backbone(role, model_cfg, config, transformers.AutoModel, meta, lazy)
        with torch.device("meta" if meta else "cpu"), \
                _parameters_on_meta() if lazy else contextlib.nullcontext():
            model = ValueModel(backbone, config.hidden_size, per_token)
        model.given_dropout = given
        if not meta and model_cfg.path is None:
            # A small head keeps initial values near 0 whatever the backbone's scale.
            nn.init.normal_(model.value_head.weight, std=1.0 / (config.hidden_size + 1))
            nn.init.zeros_(model.value_head.bias)
    if model_cfg.path is not None and not (meta or lazy):
        # The same values the head and LoRA get on the lazy path ([Note: fresh parameters]).
        weights.start_fresh(model, seed)
    if head is not None and not lazy:
        with torch.no_grad():
            for name, value in _head_values(head).items():
                model.get_parameter(name).copy_(value)
    return model


# Names of a scalar head in a saved model: rlhf_paro's value head, a Hugging Face
# *ForSequenceClassification's ``score`` (what TRL and OpenRLHF reward models are).
_HEAD_NAMES = ("value_head", "score")


def saved_head(directory: str | Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias or None) of the one-output head saved in ``directory``, or None."""
    from safetensors import safe_open

    directory = Path(directory).expanduser()
    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        own = file.name == VALUE_HEAD_FILE  # save_value_model's file: the head's own keys
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if parts[-1] in ("weight", "bias") and (
                        own or len(parts) >= 2 and parts[-2] in _HEAD_NAMES):
                    found.setdefault(parts[-1], f.get_tensor(key).float())
    if "weight" not in found:
        return None
    return found["weight"], found.get("bias")


def _head_values(head: tuple[torch.Tensor, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """A saved head as the value head's parameters; a classifier's score has no bias: 0."""
    weight, bias = head
    return {"value_head.weight": weight.reshape(1, -1),
            "value_head.bias": bias.reshape(1) if bias is not None else torch.zeros(1)}


def check_reward_directory(path: str, config: Any) -> None:
    """A reward model directory: a value model saved by rlhf_paro, or a sequence classifier
    with one label."""
    if (Path(path).expanduser() / VALUE_HEAD_FILE).is_file():
        return
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError("reward.path", f"{path!r} holds {', '.join(architectures) or 'no'} "
                          "architecture; allowed: a Hugging Face *ForSequenceClassification "
                          "model with one label (reward.function for a Python reward)")
    if getattr(config, "num_labels", 1) != 1:
        raise ConfigError("reward.path", f"{path!r} has {config.num_labels} labels; allowed: 1")


def save_value_model(model: ValueModel, directory: str | Path) -> None:
    """Backbone in Hugging Face format plus the head, loadable with ``path: directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    model.backbone.save_pretrained(directory)
    head = {k: v.detach().contiguous() for k, v in model.value_head.state_dict().items()}
    save_file(head, str(directory / VALUE_HEAD_FILE))


def save_sequence_classifier(model: ValueModel, directory: str | Path, tokenizer: Any) -> None:
    """A reward model as a Hugging Face ``*ForSequenceClassification`` with one label (what TRL
    and OpenRLHF write), with its tokenizer: loadable with ``reward.path`` and by transformers.
    The score head has no bias, so ``model``'s must be 0."""
    if float(model.value_head.bias.abs().max()) != 0.0:
        raise ValueError("a sequence classifier's score head has no bias; this one is not 0")
    config = copy.deepcopy(model.backbone.config)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    classifier = _transformers().AutoModelForSequenceClassification.from_config(config)
    inner = {f"{classifier.base_model_prefix}.{k}": v
             for k, v in model.backbone.state_dict().items()}
    inner["score.weight"] = model.value_head.weight.detach()
    classifier.load_state_dict(inner, strict=True)
    classifier.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def build_model(role: str, model_cfg: ModelConfig, vocab_size: int, *, seed: int = 0,
                meta: bool = False, lazy: bool = False) -> nn.Module:
    """The module of one PPO role; ref and reward come frozen (no parameter requires grad).
    ``lazy`` (a ``path`` only): parameters on the meta device, buffers real, for
    ``build_for_setup``."""
    if role in ("actor", "ref"):
        model: nn.Module = build_causal_lm(model_cfg, vocab_size, role=role, seed=seed,
                                           meta=meta, lazy=lazy)
    elif role in ("critic", "reward"):
        model = build_value_model(model_cfg, vocab_size, role=role, per_token=role == "critic",
                                  seed=seed, meta=meta, lazy=lazy)
    else:
        raise ValueError(f"unknown model role {role!r}; allowed: {', '.join(ROLES)}")
    if role in FROZEN_ROLES:
        model.requires_grad_(False)
        model.eval()
    return model


def build_for_setup(role: str, model_cfg: ModelConfig, vocab_size: int, *, seed: int = 0
                    ) -> tuple[nn.Module, Callable[[str, int, int], torch.Tensor] | None]:
    """The module of one PPO role and the ``source`` that ``shard`` fills its shards from.

    A model read from a directory of safetensors files comes with its parameters on the meta
    device and a reader of the files, the same weights ``build_model`` loads, bit for bit. A
    model from an inline config (random init) is built whole (docs/design.md, "Setup"), and
    so is one whose files name a parameter as only transformers' conversions on load would
    find it (with a warning); their source is None: the parameters' own values.
    """
    files = None if model_cfg.path is None else weights.model_files(model_cfg.path)
    if files is not None:
        model = build_model(role, model_cfg, vocab_size, seed=seed, lazy=True)
        inner = model.lm if isinstance(model, CausalLM) else model.backbone
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        head = saved_head(model_cfg.path) if isinstance(model, ValueModel) else None
        wrapper = "lm." if isinstance(model, CausalLM) else "backbone."
        try:
            return model, weights.file_source(
                model, TensorFiles(files), wrapper=wrapper, base_prefix=base.base_model_prefix,
                seed=seed, given=_head_values(head) if head is not None else None)
        except weights.MissingWeights as err:
            warnings.warn(f"{role}.path: {err}; the model is built whole on every rank",
                          stacklevel=2)
        except ValueError as err:  # damaged files, or weights of other shapes
            raise ConfigError(f"{role}.path", f"cannot load the weights in {model_cfg.path!r} "
                              f"({err}); allowed: a directory saved by save_pretrained"
                              ) from None
    return build_model(role, model_cfg, vocab_size, seed=seed), None


def count_parameters(role: str, model_cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """(Psi, Psi'): all parameters and trainable ones, counted on the meta device."""
    model = build_model(role, model_cfg, vocab_size, meta=True)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable



def hf_name(model: nn.Module, name: str) -> str | None:
    """The Hugging Face name of ``name``, a key of ``model``'s state (``engine.full_state_dict()``):
    its name in the wrapped causal LM (a PEFT model's own names under LoRA), or in a value
    model's backbone; None for the value head, which lies outside the Hugging Face model. What an
    export writes and what a rollout engine's weight sync loads by."""
    if isinstance(model, CausalLM):
        return name.removeprefix("lm.")
    if isinstance(model, ValueModel):
        return name.removeprefix("backbone.") if name.startswith("backbone.") else None
    raise TypeError(f"no Hugging Face names for {type(model).__name__}")


def hf_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under its Hugging Face names (``hf_name``), without what has none."""
    named = ((hf_name(model, k), v) for k, v in state.items())
    return {k: v for k, v in named if k is not None}


# What a rollout engine's sync takes of the actor (``hf_weights``): the plain model's weights,
# a LoRA actor's with its adapters merged in (``MERGED``); a LoRA actor's base weights without
# them (``BASE``, taken once) and its adapters alone (``ADAPTERS``, each sync after that).
MERGED, BASE, ADAPTERS = "merged", "base", "adapters"


def hf_weights(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], lora_scale: float,
               part: str = MERGED) -> Iterator[tuple[str, torch.Tensor]]:
    """The causal LM ``model``'s parameters ``named`` (engine names, a unit at a time) as the
    plain Hugging Face model's weights, in the same order: what a rollout engine loads. Under
    LoRA (a PEFT model) ``part`` says which: ``MERGED``, each adapted linear W + ``lora_scale``
    B A (alpha / r, ``lora_merged``) once its base weight and both factors have come, which one
    unit holds; ``BASE``, W alone; ``ADAPTERS``, the factors alone, as
    ``<linear>.lora_A.weight`` and ``<linear>.lora_B.weight`` (PEFT's saved names without its
    ``base_model.model.`` prefix), for which ``named`` may hold the trained parameters only."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # adapted linear -> the pieces seen
    for name, tensor in named:
        name = hf_name(model, name)
        if name is None:
            continue
        name = name.removeprefix("base_model.model.")
        linear, piece = _lora_piece(name)
        if part == ADAPTERS:
            if piece in ("lora_A", "lora_B"):
                yield f"{linear}.{piece}.weight", tensor
            continue
        if linear is None:
            yield name, tensor
        elif piece == "bias":
            yield f"{linear}.bias", tensor
        elif part == BASE:
            if piece == "base":
                yield f"{linear}.weight", tensor
        else:
            pieces = pending.setdefault(linear, {})
            pieces[piece] = tensor
            if len(pieces) == 3:
                del pending[linear]
                yield f"{linear}.weight", lora_merged(pieces["base"], pieces["lora_A"],
                                                      pieces["lora_B"], lora_scale)
    assert not pending, f"adapted linears without all their pieces: {sorted(pending)}"


def lora_merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
                ) -> torch.Tensor:
    """An adapted linear's weight with its adapter merged in, W + ``scale`` B A, in fp32 and
    rounded once to W's dtype: the one expression every merged sync computes, on the actor's
    side (``hf_weights``) or on a replica's (``rollout.hf.HFReplica``), so both load the same
    weights to the bit."""
    return (base.float() + scale * (b.float() @ a.float())).to(base.dtype)


def _lora_piece(name: str) -> tuple[str | None, str]:
    """(the adapted linear, which piece) of a PEFT parameter name; (None, "") otherwise."""
    for marker, piece in ((".base_layer.weight", "base"), (".base_layer.bias", "bias"),
                          (".lora_A.", "lora_A"), (".lora_B.", "lora_B")):
        if marker in name:
            return name[:name.index(marker)], piece
    return None, ""


def export_hf(model: nn.Module, state: dict[str, torch.Tensor], directory: str | Path,
              tokenizer: Any = None, merge_lora: bool = False) -> Path:
    """Write ``model`` with the full state ``state`` (``engine.full_state_dict()``) in Hugging
    Face format to ``directory``, with the tokenizer: a causal LM for ``from_pretrained``, a LoRA
    actor as its PEFT adapter (and the merged model under ``merged/`` with ``merge_lora``), a
    value model as its backbone plus the value head (``save_value_model``).

    Safetensors, written under a temporary name next to ``directory`` and renamed when
    complete, so a directory that exists is whole.
    """
    import shutil
    import tempfile

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        with _given_dropout(model, getattr(model, "given_dropout", {})):
            _write_hf(model, state, scratch, tokenizer, merge_lora)
        _readable(scratch)
        old = None
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{scratch.name[-8:]}")
            os.replace(directory, old)
        os.replace(scratch, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return directory


def _write_hf(model: nn.Module, state: dict[str, torch.Tensor], scratch: Path, tokenizer: Any,
              merge_lora: bool) -> None:
    """``export_hf``'s files, written into the directory ``scratch``."""
    if isinstance(model, CausalLM):
        inner = hf_state_dict(model, state)
        model.lm.save_pretrained(scratch, state_dict=inner, safe_serialization=True)
        if merge_lora and hasattr(model.lm, "merge_and_unload"):
            _merged(model.lm, inner).save_pretrained(scratch / "merged", safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(scratch / "merged")
    elif isinstance(model, ValueModel):
        inner = hf_state_dict(model, state)
        model.backbone.save_pretrained(scratch, state_dict=inner, safe_serialization=True)
        from safetensors.torch import save_file

        head = {k.removeprefix("value_head."): v.contiguous() for k, v in state.items()
                if k.startswith("value_head.")}
        save_file(head, str(scratch / VALUE_HEAD_FILE))
    else:
        raise TypeError(f"cannot export {type(model).__name__}")
    if tokenizer is not None:
        tokenizer.save_pretrained(scratch)


def _readable(directory: Path) -> None:
    """Modes of a written model as of a file the user wrote, within their umask: mkdtemp made the
    directory 0700, and an export is for others on a shared cluster to read too."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        if path.is_dir():
            path.chmod(0o777 & ~umask)
        elif path.is_file():
            path.chmod(0o666 & ~umask)


def _merged(peft_model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh copy of a PEFT model with ``state`` loaded and its adapters merged in."""
    import peft

    base_config = peft_model.get_base_model().config
    with torch.device("meta"):
        base = _transformers().AutoModelForCausalLM.from_config(base_config)
    copy = peft.get_peft_model(base, peft_model.peft_config["default"])
    copy.load_state_dict(state, assign=True, strict=False)
    return copy.merge_and_unload()
