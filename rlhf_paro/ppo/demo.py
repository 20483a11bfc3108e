"""The default run's assets, made the way a user would bring theirs, on first use, then cached.

``conf/ppo_tiny.yaml`` points at them through the keys a user sets (``${demo:NAME}``). Naming
an asset and making it are two steps: while a conf is composed, ``${demo:NAME}`` (``resolver``,
which the entry points register) is the asset's path when the cache holds it and stays
``${demo:NAME}`` otherwise, so ``--help`` and ``--cfg job`` make nothing; ``make_assets``, run by
``rlhf_paro.resolve`` before a run or a plan, makes what is missing:

- ``actor`` (``actor.path``): a Hugging Face Llama directory (``task.model``) with a real
  ``tokenizers`` word-level tokenizer over the task's symbols, saved by ``save_pretrained``. The
  weights are a short supervised fine-tune (``task.sft_steps``) on demonstrations of mixed skill
  (``CountingTask.sample_responses``), so the policy counts some of the time: a reference worth
  a KL penalty, with room for PPO to improve on.
- ``reward`` (``reward.path``): a Hugging Face ``*ForSequenceClassification`` directory with one
  label: the same architecture trained with the Bradley-Terry loss on preference pairs that
  the task's score labels (``task.reward_*``).
- ``train`` and ``val`` (``data.train_files``, ``data.val_files``): prompt files in jsonl, one
  ``prompt`` column of symbols and the columns the score function reads.
- ``score`` (``reward.score_function``): the counting score as a reward function,
  ``ppo/task.py:counting_score``, logged but never trained on.

The multi-turn demo (``conf/grpo_agent_tiny.yaml``) plays the guessing game of ``envs/guess.py``
and has assets of its own, in a cache entry of their own (``agent_cache_key``):

- ``guess`` (``env.function``): the game, ``envs/guess.py:GuessEnv``.
- ``agent_actor``: the same architecture with the game's words (``guess``, ``higher``,
  ``lower``) in its vocabulary, fine-tuned (``task.sft_*``) on games of mixed skill
  (``guess.demonstration``) in the exact tokens a run's episodes have (prompt, actions,
  observations), the loss on the actions only: it wins some of the time.
- ``agent_train`` and ``agent_val``: prompt files whose rows carry the hidden symbol
  (``secret``), from which each sample's game is built.

The Blackjack demo (``conf/grpo_blackjack_tiny.yaml``) plays the README's example environment,
gymnasium's Blackjack, with assets made the same way in an entry of their own:

- ``blackjack`` (``env.function``): ``examples/blackjack_env.py:Blackjack`` of the repository.
- ``blackjack_actor``: the same architecture with the game's words (the prompt's and every
  hand's description) in its vocabulary, fine-tuned on games whose every answer is ``hit`` or
  ``stick`` at random, so it answers each hand with one word and plays a random policy.
- ``blackjack_train`` and ``blackjack_val``: the prompt (``BLACKJACK_PROMPT``) in every row.

The cache key is everything that determines the assets; a directory appears whole or not at all
(built under a scratch name, then renamed), so a crash or two runs at once leave nothing half
written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rlhf_paro import usercode
from rlhf_paro.config import (
    Config, ConfigError, EnvConfig, ModelConfig, PPOConfig, TaskConfig, build, build_config,
)
from rlhf_paro.envs import guess
from rlhf_paro.models import build_causal_lm, build_value_model, count_parameters
from rlhf_paro.ppo import task as task_module
from rlhf_paro.ppo.task import CountingTask, PreferencePairs, SymbolTokenizer
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch, join

# Bumped when the task, the data or a training recipe change, so stale caches are not reused.
_RECIPE_VERSION = 2

# Bumped, per game, when the game, its demonstrations or the agent's SFT change.
_AGENT_RECIPE_VERSION = {"guess": 1, "blackjack": 1}

# The names ${demo:NAME} takes: the single-turn demo's, then the multi-turn demos'.
ASSETS = ("actor", "reward", "train", "val", "score",
          "agent_actor", "agent_train", "agent_val", "guess",
          "blackjack_actor", "blackjack_train", "blackjack_val", "blackjack")
# The multi-turn demos' assets: the game each is made for, by the name's prefix (which also
# prefixes the cache entry's name).
_AGENT_GAMES = {"agent": "guess", "blackjack": "blackjack"}

# The counting score as ``reward.score_function`` names it.
SCORE_FUNCTION = f"{Path(task_module.__file__).resolve()}:counting_score"
# The guessing game as ``env.function`` names it.
GUESS_ENV = f"{Path(guess.__file__).resolve()}:GuessEnv"
# The README's example environment as ``env.function`` names it: examples/ beside the package,
# so the Blackjack demo runs from a clone of the repository whatever the working directory.
BLACKJACK_ENV = f"{Path(__file__).resolve().parents[2] / 'examples' / 'blackjack_env.py'}:Blackjack"
# Assets that are code: nothing to make.
_CODE = {"score": SCORE_FUNCTION, "guess": GUESS_ENV, "blackjack": BLACKJACK_ENV}

# Training in-process is meant for small models; a big demo model would take hours on a CPU.
MAX_DEMO_PARAMS = 50_000_000


# Where each asset lies in a cache entry (which also holds meta.json: what was measured when
# it was made).
_FILES = {"actor": "actor", "reward": "reward", "train": "train.jsonl", "val": "val.jsonl",
          "agent_actor": "actor", "agent_train": "train.jsonl", "agent_val": "val.jsonl",
          "blackjack_actor": "actor", "blackjack_train": "train.jsonl",
          "blackjack_val": "val.jsonl"}


def cache_root(task: TaskConfig) -> Path:
    return Path(task.cache_dir or Path.home() / ".cache" / "rlhf_paro").expanduser()


def cache_key(task: TaskConfig, response_len: int) -> str:
    """Hash of everything that determines the assets."""
    spec = dataclasses.asdict(task)
    spec.pop("cache_dir")
    spec.update(version=_RECIPE_VERSION, response_len=response_len)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


# ``${demo:NAME}`` left in a composed config: an asset not made yet.
REFERENCE = re.compile(r"\$\{demo:([^}]*)\}")


def _entry(task: TaskConfig, response_len: int) -> Path:
    return cache_root(task) / f"demo-{cache_key(task, response_len)}"


# What of the task section the agent's assets depend on (not the reward model's training).
_AGENT_TASK_KEYS = ("num_symbols", "model", "sft_steps", "sft_batch_size", "sft_lr",
                    "train_prompts", "val_prompts")


def agent_cache_key(task: TaskConfig, max_turns: int, game: str = "guess") -> str:
    """Hash of everything that determines a multi-turn demo's assets: the game, its alphabet,
    the model, the SFT and the turns of its demonstrations (``env.max_turns``)."""
    spec = {key: getattr(task, key) for key in _AGENT_TASK_KEYS}
    spec.update(version=_AGENT_RECIPE_VERSION[game], game=game, max_turns=max_turns)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _agent_prefix(name: str) -> str | None:
    """The multi-turn demo an asset name belongs to (``_AGENT_GAMES``' key), or None."""
    prefix = name.split("_")[0]
    return prefix if prefix in _AGENT_GAMES and name not in _CODE else None


def _agent_entry(task: TaskConfig, max_turns: int, prefix: str = "agent") -> Path:
    key = agent_cache_key(task, max_turns, _AGENT_GAMES[prefix])
    return cache_root(task) / f"{prefix}-{key}"


def _check_name(name: str) -> None:
    if name not in ASSETS:
        raise ConfigError("demo", f"no asset {name!r}; allowed: {', '.join(ASSETS)}")


def resolver(name: str, *, _root_: Any) -> str:
    """``${demo:NAME}`` while a conf is composed: the asset's path when it is made (or needs no
    making: the score), else ``${demo:NAME}`` itself, for ``make_assets``. Reads the cache,
    writes nothing. The cache key is the conf's ``task`` section and ``ppo.max_new_tokens``
    (``env.max_turns`` for the agent's assets)."""
    from omegaconf import OmegaConf

    _check_name(name)
    if name in _CODE:
        return _CODE[name]

    def section(key: str) -> dict[str, Any]:
        node = _root_.get(key)
        return {} if node is None else OmegaConf.to_container(node, resolve=True)

    task = build(TaskConfig, section("task"), "task")
    if prefix := _agent_prefix(name):
        entry = _agent_entry(task, build(EnvConfig, section("env"), "env").max_turns, prefix)
    else:
        entry = _entry(task, build(PPOConfig, section("ppo"), "ppo").max_new_tokens)
    return str(entry / _FILES[name]) if (entry / "meta.json").is_file() else f"${{demo:{name}}}"


def make_assets(cfg: Config) -> Config:
    """``cfg`` with every ``${demo:NAME}`` it still holds replaced by the made asset's path
    (``make``: once, then cached); ``cfg`` itself when it holds none."""
    data = cfg.to_dict()
    found = False

    def replace(value: Any) -> Any:
        nonlocal found
        if isinstance(value, dict):
            return {k: replace(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(replace(v) for v in value)
        if isinstance(value, str) and REFERENCE.search(value):
            found = True
            return REFERENCE.sub(lambda m: asset(m.group(1), cfg.task, cfg.ppo.max_new_tokens,
                                                 cfg.env.max_turns), value)
        return value

    data = replace(data)
    return build_config(data) if found else cfg


def asset(name: str, task: TaskConfig, response_len: int,
          max_turns: int = EnvConfig.max_turns) -> str:
    """The path of one asset (``ASSETS``), made first if the cache has none; ``max_turns``
    (``env.max_turns``) keys the agent's."""
    _check_name(name)
    if name in _CODE:
        return _CODE[name]
    if prefix := _agent_prefix(name):
        return str(make_agent(task, max_turns, prefix) / _FILES[name])
    return str(make(task, response_len) / _FILES[name])


def make(task: TaskConfig, response_len: int) -> Path:
    """The demo's cache entry, made now if missing (a minute or less with the defaults)."""
    target = _entry(task, response_len)
    meta_file = target / "meta.json"
    if meta_file.is_file():
        return target
    counting = CountingTask(task.num_symbols, task.prompt_len, response_len)
    vocab_size = len(_tokenizer_vocab(counting))
    model_cfg = _demo_model(task, vocab_size)

    def build(scratch: Path) -> dict[str, Any]:
        tokenizer = make_tokenizer(counting)
        meta: dict[str, Any] = {"key": target.name}
        meta.update(_sft_actor(task, counting, model_cfg, vocab_size, tokenizer, scratch / "actor"))
        meta.update(_reward_model(task, counting, model_cfg, vocab_size, tokenizer,
                                  scratch / "reward"))
        _write_prompts(scratch / "train.jsonl", counting, task.train_prompts, seed=11)
        _write_prompts(scratch / "val.jsonl", counting, task.val_prompts, seed=12)
        return meta

    return _made(target, build)


def _demo_model(task: TaskConfig, vocab_size: int) -> ModelConfig:
    """``task.model`` as a model section, refused when it is too big to train in-process."""
    model_cfg = ModelConfig(config=dict(task.model))
    try:
        num_params, _ = count_parameters("actor", model_cfg, vocab_size)
    except ConfigError as err:  # transformers' verdict on task.model, keyed by where it is set
        raise ConfigError(err.key.replace("actor.config", "task.model", 1), err.problem) from None
    if num_params > MAX_DEMO_PARAMS:
        raise ConfigError("task.model", f"the demo's models are trained in-process only up to "
                          f"{MAX_DEMO_PARAMS:,} parameters (this one has {num_params:,}); "
                          "allowed: a smaller task.model, or your own actor.path and reward.path")
    return model_cfg


def _made(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """``target``, a cache entry that ``build(scratch)`` fills (returning its meta.json), put in
    place whole: built under a scratch name, then renamed."""
    meta_file = target / "meta.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    threads = torch.get_num_threads()
    # One thread: on a small shared CPU, threads fighting over cores make tiny matmuls 10x slower.
    torch.set_num_threads(1)
    try:
        _transformers_quiet()
        _say(f"making the demo's assets in {target} (once; cached after)")
        meta = build(scratch)
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(scratch, target)
    except OSError:
        # Another process put the same demo in place first; theirs is as good as ours.
        shutil.rmtree(scratch, ignore_errors=True)
        if not meta_file.is_file():
            raise
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return target


def _transformers_quiet() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own lines say what is happening


def _say(text: str) -> None:
    # stderr: `--cfg job` prints the config on stdout, and this must not mix into it.
    print(f"demo: {text}", file=sys.stderr, flush=True)


# -- tokenizer ---------------------------------------------------------------------------------

def _tokenizer_vocab(counting: CountingTask, words: tuple[str, ...] = ()) -> dict[str, int]:
    # The task's own ids (<pad> 0, <bos> 1, <eos> 2, then the symbols), so the task's score on
    # ids and the tokenizer agree; then ``words`` (the agent's game); <unk> last, which the task
    # never produces.
    vocab = list(counting.tokenizer.vocab)
    return {token: i for i, token in enumerate([*vocab, *words, "<unk>"])}


def make_tokenizer(counting: CountingTask, words: tuple[str, ...] = ()) -> Any:
    """A ``tokenizers`` word-level tokenizer over the task's symbols (and ``words``): ``"f g h"``
    encodes to ``<bos> f g h``; pad, bos and eos as the task's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_tokenizer_vocab(counting, words), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos = SymbolTokenizer.bos_token
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, SymbolTokenizer.bos_token_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                   eos_token=SymbolTokenizer.eos_token,
                                   pad_token=SymbolTokenizer.pad_token, unk_token="<unk>")


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           loss_fn: Callable[[], torch.Tensor], what: str) -> None:
    """``steps`` optimizer steps on ``loss_fn()``, a progress line every quarter; leaves the
    model in eval mode."""
    model.train()
    for step in range(steps):
        loss = loss_fn()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % max(steps // 4, 1) == 0:
            _say(f"{what}: step {step + 1}/{steps}, loss {loss.item():.3f}")
    model.eval()


# -- the SFT'd actor ---------------------------------------------------------------------------

def _sft_actor(task: TaskConfig, counting: CountingTask, model_cfg: ModelConfig,
               vocab_size: int, tokenizer: Any, directory: Path) -> dict[str, float]:
    """Next-token cross-entropy on the responses of mixed-skill demonstrations."""
    model = build_causal_lm(model_cfg, vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.sft_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(21)

    def loss() -> torch.Tensor:
        prompts = counting.sample_prompts(task.sft_batch_size, generator)
        responses = counting.sample_responses(prompts, generator)
        batch = _joined(prompts, responses)
        logp = model(batch.sequences, batch.attention_mask, response_len=batch.response_len)
        return -(logp * batch.action_mask).sum() / batch.action_mask.sum()

    _train(model, optimizer, task.sft_steps, loss, "SFT of the actor")
    score = _sampled_score(model, counting, generator)
    model.lm.generation_config.pad_token_id = SymbolTokenizer.pad_token_id
    model.lm.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return {"sft_steps": task.sft_steps, "sft_sampled_score": score}


@torch.no_grad()
def _sampled_score(model: torch.nn.Module, counting: CountingTask,
                  generator: torch.Generator) -> float:
    """Mean task score of sampled responses to 256 prompts: how well the SFT policy counts."""
    prompts = counting.sample_prompts(256, generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(22)  # generate samples from the global generator
        out = model.generate(prompts, torch.ones_like(prompts), do_sample=True, top_k=0,
                             max_new_tokens=counting.response_len,
                             eos_token_id=SymbolTokenizer.eos_token_id,
                             pad_token_id=SymbolTokenizer.pad_token_id)
    responses = out[:, prompts.shape[1]:]
    return float(counting.score(prompts, responses).mean())


# -- the reward model --------------------------------------------------------------------------

def _score_pairs(model: torch.nn.Module, pairs: PreferencePairs) -> tuple[torch.Tensor, ...]:
    """(chosen scores, rejected scores), both sides in one forward."""
    prompts = torch.cat([pairs.prompts, pairs.prompts])
    batch = _joined(prompts, torch.cat([pairs.chosen, pairs.rejected]))
    return model(batch.sequences, batch.attention_mask).chunk(2)


def _joined(prompts: torch.Tensor, responses: torch.Tensor) -> RolloutBatch:
    """The task's prompts (no padding) and responses as a rollout batch."""
    return join(PromptBatch(prompts, torch.ones_like(prompts)), responses,
                SymbolTokenizer.eos_token_id)


def pairwise_accuracy(model: torch.nn.Module, pairs: PreferencePairs, batch: int = 256) -> float:
    """Fraction of pairs in which the model scores the chosen response above the rejected one."""
    wins = 0
    with torch.no_grad():
        for start in range(0, pairs.prompts.shape[0], batch):
            part = PreferencePairs(*(x[start:start + batch] for x in dataclasses.astuple(pairs)))
            chosen, rejected = _score_pairs(model, part)
            wins += int((chosen > rejected).sum())
    return wins / pairs.prompts.shape[0]


def _reward_model(task: TaskConfig, counting: CountingTask, model_cfg: ModelConfig,
                  vocab_size: int, tokenizer: Any, directory: Path) -> dict[str, float]:
    """Bradley-Terry on preference pairs labelled by the task's score, saved as a Hugging Face
    sequence classifier with one label."""
    from rlhf_paro.models import save_sequence_classifier

    train = counting.preference_pairs(task.reward_pairs, seed=1)
    model = build_value_model(model_cfg, vocab_size, role="reward", per_token=False, seed=0)
    # The loss sees only score differences, so the head's bias keeps its initial 0 and the
    # classifier's bias-free score head holds the model exactly.
    model.value_head.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=task.reward_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(3)

    def loss() -> torch.Tensor:
        index = torch.randint(0, task.reward_pairs, (task.reward_batch_size,),
                              generator=generator)
        chosen, rejected = _score_pairs(model, PreferencePairs(
            train.prompts[index], train.chosen[index], train.rejected[index]))
        return -F.logsigmoid(chosen - rejected).mean()

    _train(model, optimizer, task.reward_steps, loss, "reward model")
    # Seed 2: pairs apart from the training pairs (seed 1).
    accuracy = pairwise_accuracy(model, counting.preference_pairs(task.reward_eval_pairs, seed=2))
    save_sequence_classifier(model, directory, tokenizer)
    return {"reward_steps": task.reward_steps, "reward_accuracy": accuracy}


# -- prompt files ------------------------------------------------------------------------------

def _write_prompts(file: Path, counting: CountingTask, num: int, seed: int) -> None:
    """``num`` prompts as text (``<bos>`` is the tokenizer's to add), with the columns
    ``counting_score`` reads."""
    prompts = counting.sample_prompts(num, torch.Generator().manual_seed(seed))
    tokenizer = counting.tokenizer
    with open(file, "w") as f:
        for row in prompts:
            f.write(json.dumps({"prompt": tokenizer.decode(row[1:]),
                                "num_symbols": counting.num_symbols,
                                "response_len": counting.response_len}) + "\n")


# -- the multi-turn demo: the guessing game's actor and prompts ---------------------------------

# The game's words in the agent's vocabulary: the prompt and the two observations.
_AGENT_WORDS = (guess.PROMPT, guess.HIGHER, guess.LOWER)
# Demonstrations by skill (``guess.demonstration``): mostly guessers that ignore the feedback or
# use it loosely, so the SFT'd policy wins some games and GRPO has the feedback's worth to find.
_AGENT_SKILL_MIX = {"random": 0.5, "consistent": 0.3, "bisect": 0.2}
# Games the SFT'd policy plays to measure its win rate (meta.json's ``sft_win_rate``).
_AGENT_EVAL_GAMES = 256


def make_agent(task: TaskConfig, max_turns: int, prefix: str = "agent") -> Path:
    """A multi-turn demo's cache entry (``PREFIX_actor``, ``PREFIX_train``, ``PREFIX_val``;
    ``_AGENT_GAMES``), made now if missing (seconds with the defaults)."""
    target = _agent_entry(task, max_turns, prefix)
    if (target / "meta.json").is_file():
        return target
    counting = CountingTask(task.num_symbols, task.prompt_len, 1)
    blackjack = _AGENT_GAMES[prefix] == "blackjack"
    words = _blackjack_words() if blackjack else _AGENT_WORDS
    vocab_size = len(_tokenizer_vocab(counting, words))
    model_cfg = _demo_model(task, vocab_size)

    def build(scratch: Path) -> dict[str, Any]:
        tokenizer = make_tokenizer(counting, words)
        meta: dict[str, Any] = {"key": target.name}
        sft = _sft_blackjack if blackjack else _sft_agent
        meta.update(sft(task, max_turns, model_cfg, vocab_size, tokenizer, scratch / "actor"))
        for name, num, seed in (("train", task.train_prompts, 11), ("val", task.val_prompts, 12)):
            if blackjack:
                _write_rows(scratch / f"{name}.jsonl", [{"prompt": BLACKJACK_PROMPT}] * num)
            else:
                _write_games(scratch / f"{name}.jsonl", task.num_symbols, num, seed)
        return meta

    return _made(target, build)


class _GameTokens:
    """A game's text in the agent tokenizer's ids, as a run's episodes hold it: the prompt as
    the data loader encodes it (``<bos>`` added), an action as its symbol then <eos>, an
    observation as ``envs.Observations`` encodes text (no special tokens)."""

    def __init__(self, tokenizer: Any, num_symbols: int) -> None:
        self.prompt = tokenizer(guess.PROMPT)["input_ids"]
        words = [*guess.alphabet(num_symbols), guess.HIGHER, guess.LOWER]
        self.word = {w: tokenizer(w, add_special_tokens=False)["input_ids"] for w in words}
        self.eos = tokenizer.eos_token_id

    def episode(self, turns: list[tuple[str, str | None]]) -> tuple[list[int], list[float]]:
        """(ids, 1 on action tokens) of a game's prompt and turns."""
        ids, actions = list(self.prompt), [0.0] * len(self.prompt)
        for action, observation in turns:
            act = [*self.word[action], self.eos]
            ids += act
            actions += [1.0] * len(act)
            if observation is not None:
                ids += self.word[observation]
                actions += [0.0] * len(self.word[observation])
        return ids, actions


def _padded(episodes: list[tuple[list[int], list[float]]]) -> tuple[torch.Tensor, ...]:
    """(ids right-padded with <pad>, 1 on real tokens, 1 on action tokens) of episodes."""
    width = max(len(ids) for ids, _ in episodes)
    ids = torch.zeros(len(episodes), width, dtype=torch.long)
    real, actions = torch.zeros_like(ids), torch.zeros(len(episodes), width)
    for row, (seq, act) in enumerate(episodes):
        ids[row, :len(seq)] = torch.tensor(seq)
        real[row, :len(seq)] = 1
        actions[row, :len(seq)] = torch.tensor(act)
    return ids, real, actions


def _sft_on_episodes(task: TaskConfig, model_cfg: ModelConfig, vocab_size: int,
                     episode: Callable[[], tuple[list[int], list[float]]],
                     what: str) -> torch.nn.Module:
    """A new model trained by next-token cross-entropy on the action tokens of ``episode()``'s
    episodes (``task.sft_batch_size`` a step); the prompt and the observations are context
    only, as in a run."""
    model = build_causal_lm(model_cfg, vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.sft_lr, weight_decay=0.0)

    def loss() -> torch.Tensor:
        ids, real, actions = _padded([episode() for _ in range(task.sft_batch_size)])
        logp = model(ids, real, response_len=ids.shape[1] - 1)  # of tokens 1.., from their past
        mask = actions[:, 1:]
        return -(logp * mask).sum() / mask.sum()

    _train(model, optimizer, task.sft_steps, loss, what)
    return model


def _save_actor(model: torch.nn.Module, tokenizer: Any, directory: Path) -> None:
    model.lm.generation_config.pad_token_id = tokenizer.pad_token_id
    model.lm.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _sft_agent(task: TaskConfig, max_turns: int, model_cfg: ModelConfig, vocab_size: int,
               tokenizer: Any, directory: Path) -> dict[str, float]:
    """The guessing game's agent: SFT on games played by scripted guessers of mixed skill."""
    rng = random.Random(21)
    game = _GameTokens(tokenizer, task.num_symbols)
    symbols = guess.alphabet(task.num_symbols)
    skills, weights = list(_AGENT_SKILL_MIX), list(_AGENT_SKILL_MIX.values())

    def episode() -> tuple[list[int], list[float]]:
        return game.episode(guess.demonstration(
            rng.choice(symbols), task.num_symbols, max_turns,
            rng.choices(skills, weights)[0], rng)[0])

    model = _sft_on_episodes(task, model_cfg, vocab_size, episode, "SFT of the agent")
    win_rate = play(model, tokenizer, task.num_symbols, max_turns, _AGENT_EVAL_GAMES, seed=22)
    _save_actor(model, tokenizer, directory)
    return {"sft_steps": task.sft_steps, "sft_win_rate": win_rate}


@torch.no_grad()
def play(model: torch.nn.Module, tokenizer: Any, num_symbols: int, max_turns: int,
         games: int, seed: int) -> float:
    """The win rate of ``model`` over ``games`` games of random hidden symbols, each action
    sampled (temperature 1, all tokens) as a symbol and <eos>, at most two tokens, decoded and
    stepped as a run does."""
    rng = random.Random(seed)
    symbols = guess.alphabet(num_symbols)
    envs = [guess.GuessEnv(guess.PROMPT, rng.choice(symbols), num_symbols) for _ in range(games)]
    game = _GameTokens(tokenizer, num_symbols)
    contexts = [list(game.prompt) for _ in envs]
    active, wins = list(range(games)), 0.0
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_turns):
        if not active:
            break
        # Every game still on has taken actions of a symbol and <eos> and seen one word after
        # each: their contexts are equally long, no padding needed.
        ids = torch.tensor([contexts[i] for i in active])
        action = torch.empty(len(active), 0, dtype=torch.long)
        for _ in range(2):
            seq = torch.cat([ids, action], dim=1)
            logits = model(seq, torch.ones_like(seq))[:, -1].float()
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            action = torch.cat([action, token], dim=1)
        still = []
        for row, i in enumerate(active):
            taken = action[row].tolist()
            if taken[0] == tokenizer.eos_token_id:
                taken = taken[:1]  # an action ends at its first <eos>
            observation, reward, done = envs[i].step(
                tokenizer.decode(taken, skip_special_tokens=True))
            wins += reward
            if not done:
                contexts[i] += taken + game.word[observation]
                still.append(i)
        active = still
    return wins / games


def _write_games(file: Path, num_symbols: int, num: int, seed: int) -> None:
    """``num`` rows of the game: the prompt, the hidden symbol drawn at random, the alphabet's
    size (``GuessEnv(**row)``)."""
    rng = random.Random(seed)
    symbols = guess.alphabet(num_symbols)
    _write_rows(file, [{"prompt": guess.PROMPT, "secret": rng.choice(symbols),
                        "num_symbols": num_symbols} for _ in range(num)])


def _write_rows(file: Path, rows: list[dict[str, Any]]) -> None:
    with open(file, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# -- the Blackjack demo: the README's example environment's actor and prompts -------------------

# Every row's prompt: the instruction before the first hand (README, "Multi-turn agents").
BLACKJACK_PROMPT = "We play Blackjack. Answer each hand with one word: hit or stick."
# The answers the SFT'd policy gives, each as often: a random policy for GRPO to improve on.
BLACKJACK_ANSWERS = ("hit", "stick")
# Demonstrations whose probabilities meta.json reports.
_BLACKJACK_EVAL_GAMES = 256


def _blackjack_env() -> Any:
    return usercode.load_function(BLACKJACK_ENV, "env.function")()


def _blackjack_words() -> tuple[str, ...]:
    """The words of the prompt, the answers and every hand's description (a total of 4 to 21,
    12 up with a usable ace; the dealer's card 1 to 10), as the word-level tokenizer splits
    them (at whitespace: "14;" is a word)."""
    env = _blackjack_env()
    texts = [BLACKJACK_PROMPT, *BLACKJACK_ANSWERS]
    texts += [env.describe((total, dealer, ace)) for total in range(4, 22)
              for dealer in range(1, 11) for ace in (False, True) if total >= 12 or not ace]
    return tuple(dict.fromkeys(word for text in texts for word in text.split()))


def _blackjack_episode(env: Any, tokenizer: Any, max_turns: int, seed: int,
                       answer: Callable[[], str]) -> tuple[list[int], list[float], float]:
    """(ids, 1 on action tokens, score) of the game dealt from ``seed`` whose answers are
    ``answer()``'s, in the tokens a run's episode holds: the prompt as the data loader encodes it
    (<bos> added), an answer and <eos>, a hand's description without special tokens."""
    ids = tokenizer(BLACKJACK_PROMPT)["input_ids"]
    actions = [0.0] * len(ids)
    observation, score = env.reset(seed=seed), 0.0
    for _ in range(max_turns):
        seen = tokenizer(observation, add_special_tokens=False)["input_ids"]
        answer_now = answer()
        act = [*tokenizer(answer_now, add_special_tokens=False)["input_ids"],
               tokenizer.eos_token_id]
        ids += seen + act
        actions += [0.0] * len(seen) + [1.0] * len(act)
        observation, reward, done = env.step(answer_now)
        score += reward
        if done:
            break
    return ids, actions, score


def _sft_blackjack(task: TaskConfig, max_turns: int, model_cfg: ModelConfig, vocab_size: int,
                   tokenizer: Any, directory: Path) -> dict[str, float]:
    """The Blackjack agent: SFT on games of random answers, so it answers each hand with one
    word and <eos>. meta.json: its mean probabilities, on fresh games, of ``hit`` and of either
    answer at an answer's first token and of <eos> at its second, and those games' mean score
    (a random policy's)."""
    env, rng = _blackjack_env(), random.Random(21)

    def game() -> tuple[list[int], list[float], float]:
        return _blackjack_episode(env, tokenizer, max_turns, rng.randrange(2**31),
                                  lambda: rng.choice(BLACKJACK_ANSWERS))

    model = _sft_on_episodes(task, model_cfg, vocab_size, lambda: game()[:2],
                             "SFT of the Blackjack agent")
    games = [game() for _ in range(_BLACKJACK_EVAL_GAMES)]
    ids, real, actions = _padded([game[:2] for game in games])
    with torch.no_grad():
        probs = model.lm(input_ids=ids, attention_mask=real).logits.float().softmax(-1)
    # An answer's first token at an action token whose previous token is not one; its <eos> next.
    first = (actions[:, 1:] > 0) & (actions[:, :-1] == 0)
    before = probs[:, :-1][first]  # the distribution each answer's first token was drawn from
    after = torch.zeros_like(first)
    after[:, 1:] = first[:, :-1]  # the next token's: the answer's <eos>
    eos = probs[:, :-1][after][:, tokenizer.eos_token_id]
    hit, stick = tokenizer.convert_tokens_to_ids(list(BLACKJACK_ANSWERS))
    _save_actor(model, tokenizer, directory)
    return {"sft_steps": task.sft_steps,
            "sft_hit_prob": float(before[:, hit].mean()),
            "sft_answer_prob": float((before[:, hit] + before[:, stick]).mean()),
            "sft_eos_prob": float(eos.mean()),
            "random_policy_score": sum(game[2] for game in games) / len(games)}
