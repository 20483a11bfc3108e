"""The ``hf`` rollout engine: the actor's own Hugging Face model on its own parameters, gathered
once for the whole rollout (phase ``generate`` of the actor's meter), decoded by a loop of its
own (``decode``), or by Hugging Face ``generate`` on a static cache, compiled."""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable, Iterator

import torch
from torch import Tensor

from rlhf_paro.comm.meter import GENERATE
from rlhf_paro.config import Config, ConfigError
from rlhf_paro.models import lora_merged, position_ids
from rlhf_paro.rollout.base import EngineContext, Sampling, register_engine
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch, join


@dataclass(frozen=True)
class StaticDecode:
    """Decoding on Hugging Face's static key/value cache with its decoding step compiled
    (``rollout.hf_cache=static``). The cache is as long as the run's longest sequence, whatever
    a call's prompts and budget, and the batch dimension is compiled dynamic (chunks,
    evaluations and the turns of episodes come in several sizes): one graph for the run. The
    graph reads the weights as inputs, so updates in place and fresh gathers need no recompile."""

    max_cache_len: int
    compile_config: Any  # transformers.CompileConfig

    @classmethod
    def for_run(cls, max_cache_len: int) -> StaticDecode:
        from transformers import CompileConfig

        config = CompileConfig(dynamic=True)
        # generate compiles by itself on CUDA only; this asks it to on any device.
        config._compile_all_devices = True
        return cls(max_cache_len, config)

    def kwargs(self) -> dict[str, Any]:
        return {"cache_implementation": "static", "max_cache_len": self.max_cache_len,
                "compile_config": self.compile_config}


def takes_static_cache(lm_class: type | None) -> bool:
    """Whether a Hugging Face causal LM class decodes on a static cache in one compiled graph
    (its ``_can_compile_fullgraph``, and a cache of the standard kind at all)."""
    return (lm_class is not None and bool(getattr(lm_class, "_can_compile_fullgraph", False))
            and lm_class._supports_default_dynamic_cache())


def decode_cache(setting: str, device_type: str, lm_class: type | None,
                 multi_turn: bool = False) -> str:
    """``rollout.hf_cache`` resolved for the actor's class on a device: "static" or
    "dynamic"; ``ConfigError`` for static with a model that cannot take it. ``auto`` keeps
    the dynamic cache for episodes (``multi_turn``): it carries each episode's keys and values
    from one turn to the next, where a static cache would prefill the whole context again."""
    takes = takes_static_cache(lm_class)
    if setting == "static" and not takes:
        name = "model" if lm_class is None else lm_class.__name__
        raise ConfigError("rollout.hf_cache", f"static: the actor's {name} cannot decode on a "
                                              f"static cache in one compiled graph; allowed: "
                                              f"dynamic, auto")
    if setting == "auto":
        return "static" if device_type == "cuda" and takes and not multi_turn else "dynamic"
    return setting


def static_decode(cfg: Config, lm: torch.nn.Module, device: torch.device) -> StaticDecode | None:
    """The run's static decoding for the actor's model ``lm`` (a PEFT model: the one it
    wraps), or None for the dynamic cache."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if decode_cache(cfg.rollout.hf_cache, device.type, type(base), cfg.env.enabled) == "dynamic":
        return None
    return StaticDecode.for_run(cfg.longest_sequence()[1])


def check(cfg: Config, actor_config: Any) -> None:
    """``ConfigError`` for ``rollout.hf_cache=static`` with an actor whose class cannot take
    a static cache (or whose class is its own code, which this does not load to ask)."""
    from transformers import AutoModelForCausalLM

    lm_class = AutoModelForCausalLM._model_mapping.get(type(actor_config), None)
    decode_cache(cfg.rollout.hf_cache, cfg.cluster.device, lm_class)


@contextlib.contextmanager
def plain_generation_config(lm: Any) -> Iterator[None]:
    """Hugging Face ``generate`` on ``lm`` (a PEFT model: the model it wraps) samples by its
    arguments alone while inside: a model's own generation defaults (a checkpoint's
    ``generation_config.json``: ``top_p``, ``repetition_penalty``, ``min_new_tokens``, ...) fill
    every argument a call leaves unset, and the trainer's log-probs account for the ``ppo``
    section's temperature and top-k only. They stay the model's outside (an export keeps
    them)."""
    from transformers import GenerationConfig

    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    own = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = own


class HFRollout:
    """Generates with the actor's model under ``engine.gathered()``, ``micro_batch_size``
    prompts at a time (None: all at once): the key/value cache of one chunk is what it holds.
    ``static``: decoding on a static cache, compiled (None: the dynamic cache)."""

    def __init__(self, engine: object, pad_token_id: int, eos_token_id: int,
                 device: torch.device, micro_batch_size: int | None = None,
                 static: StaticDecode | None = None) -> None:
        self.engine = engine
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.static = static
        # Requests (``submit``, ``step``) decode on the dynamic cache only.
        self.takes_requests = static is None
        # Inside turns() (dynamic cache only): the keys and values of the last call's sequences,
        # which the next turn's contexts continue (and, streaming, of every ended request).
        self.kept: TurnCache | None = None
        # Requests (``submit``, inside turns()): the model held there, the rows decoding, the
        # requests waiting to join them with the engine steps they have waited.
        self._model: Any = None
        self._decoding: Decoding | None = None
        self._waiting: list[tuple[int, list[int], Sampling, int | None]] = []
        self._waited = 0
        self._keys = itertools.count()

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, sampling: Sampling,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """Each chunk stops when its every row has ended, so its responses are as wide as its
        own longest; the chunks are then joined as wide as the rank's longest. ``seeds`` (the
        dynamic cache only): each response samples from a stream of its own seeded with its
        seed, so its tokens do not depend on the other rows; None: from the process's."""
        size = self.micro_batch_size or len(prompts)
        chunks = []
        kept = None if self.kept is None else TurnCache()
        with self.engine.gathered(phase=GENERATE) as model:
            model.eval()
            for start in range(0, len(prompts), size):
                part = prompts.select(slice(start, start + size))
                # inference_mode: a decoding step's tensors get no version counter or view
                # tracking, which no_grad still keeps (about 5% of a small batch's step on the
                # CPU, where a step is dispatcher-bound). Nothing decoded is written in place
                # or saved for a backward: join copies the rows out of it.
                with torch.inference_mode():
                    if self.static is not None:
                        responses, logprobs = self._static(model, part, sampling)
                    else:
                        ids, mask, cache = (part.input_ids, part.attention_mask, None)
                        if self.kept is not None:
                            ids, mask, cache = self.kept.continued(part, self.pad_token_id)
                        responses, logprobs = decode(
                            model.lm, ids.to(self.device), mask.to(self.device), cache,
                            sampling, self.eos_token_id, self.pad_token_id, kept,
                            None if seeds is None else seeds[start:start + size])
                chunks.append(join(part, responses.cpu(), self.eos_token_id,
                                   None if logprobs is None else logprobs.cpu()))
        if kept is not None:
            self.kept = kept  # the next turn continues this call's sequences, none before
        return chunks[0] if len(chunks) == 1 else RolloutBatch.concat(chunks, self.pad_token_id)

    def _static(self, model: Any, part: PromptBatch, sampling: Sampling
                ) -> tuple[Tensor, Tensor | None]:
        """``part``'s responses and log-probs by Hugging Face ``generate`` on the static cache,
        its decoding step compiled (``StaticDecode``)."""
        kwargs = ({"do_sample": False} if sampling.greedy else
                  {"do_sample": True, "temperature": sampling.temperature,
                   "top_k": sampling.top_k})
        ids = part.input_ids.to(self.device)
        # use_cache: a model configured without one still decodes on one.
        with plain_generation_config(model.lm):
            out = model.generate(ids, part.attention_mask.to(self.device),
                                 max_new_tokens=sampling.max_new_tokens,
                                 pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id,
                                 return_dict_in_generate=True, use_cache=True,
                                 output_logits=not sampling.greedy, **kwargs,
                                 **self.static.kwargs())
        responses = out.sequences[:, ids.shape[1]:]
        return responses, (None if sampling.greedy else
                           sampled_logprobs(out.logits, responses, sampling.temperature))

    @contextlib.contextmanager
    def turns(self) -> Iterator[None]:
        """The weights gathered once for all turns (``generate`` inside it gathers nothing:
        ``engine.gathered`` nests) and, on the dynamic cache, each sequence's keys and values
        kept from one turn to the next ([Note: keys and values across turns])."""
        with self.engine.gathered(phase=GENERATE) as model:
            self.kept = TurnCache() if self.static is None else None
            self._model = model
            try:
                yield
            finally:
                self.kept = self._model = self._decoding = None
                self._waiting.clear()
                # Joins start afresh each time: when requests join (and so the rows each step
                # decodes with) depends on the calls inside alone, as a resumed engine's does.
                self._waited = 0

    def submit(self, context: list[int], sampling: Sampling, seed: int | None) -> int:
        """One response to ``context`` as a request of its own (inside ``turns``): it joins the
        rows decoding at a later ``step`` ([Note: requests join the rows decoding])."""
        key = next(self._keys)
        self._waiting.append((key, context, sampling, seed))
        return key

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[int], list[float] | None]]:
        """One decoding step of every request in flight (the waiting ones joined first when
        it is time); the responses that ended in it.

        [Note: requests join the rows decoding]
        A request joins the rows decoding (``Decoding.start``: its context prefilled on the
        keys and values kept of its episode's last action, then both caches padded to one
        width) when no row is decoding, when the waiting requests are a quarter of the rows
        decoding, or after it has waited 16 steps: a join copies the cache and prefills apart
        from the decoding step, so joins are gathered. ``rollout.micro_batch_size`` caps the
        rows decoding at once."""
        if self._waiting:
            self._join()
        if self._decoding is None or not self._decoding.running:
            return []
        with torch.inference_mode():
            return self._decoding.step()

    def _join(self) -> None:
        decoding = self._decoding
        running = 0 if decoding is None else decoding.running
        self._waited += 1
        if running and len(self._waiting) * 4 < running and self._waited < 16:
            return
        room = max((self.micro_batch_size or len(self._waiting) + running) - running, 0)
        if running:  # rows that decode together sample alike
            same = decoding.sampling
            like = [w for w in self._waiting if _alike(w[2], same)][:room]
        else:
            first = self._waiting[0][2]
            like = [w for w in self._waiting if _alike(w[2], first)][:room]
            decoding = self._decoding = Decoding(self._model.lm, first, self.eos_token_id,
                                                 self.pad_token_id, self.kept)
        if not like:
            return
        joining = {w[0] for w in like}
        self._waiting = [w for w in self._waiting if w[0] not in joining]
        self._waited = 0
        part = PromptBatch.left_padded([w[1] for w in like], self.pad_token_id)
        with torch.inference_mode():
            ids, mask, cache = self.kept.continued(part, self.pad_token_id)
            seeds = [w[3] for w in like]
            decoding.start([w[0] for w in like], ids.to(self.device), mask.to(self.device),
                           cache, [w[2].max_new_tokens for w in like],
                           None if like[0][2].greedy else seeds)

    def abort(self, keys: list[int]) -> None:
        """Requests no one will collect: dropped waiting, ended decoding."""
        self.interrupt(keys)

    def interrupt(self, keys: list[int]) -> dict[int, tuple[list[int], list[float] | None]]:
        """Requests taken back before they end (``Interrupts``): each one's tokens so far and
        their log-probs (None when greedy); a request still waiting to join has none."""
        gone = set(keys)
        taken = {w[0]: ([], None if w[2].greedy else []) for w in self._waiting if w[0] in gone}
        self._waiting = [w for w in self._waiting if w[0] not in gone]
        if self._decoding is not None:
            # The rows' state was made under inference_mode (``step``): written there only.
            with torch.inference_mode():
                taken.update(self._decoding.abort(gone))
        return taken

    # Generation reads the engine's own parameters, gathered at each call: there is no second copy
    # of the weights to update, and nothing held between calls to release.
    needs_sync = False
    # One static batch per chunk: every row computed on as wide as the chunk's longest, its
    # prompt's left padding and the positions after its end included.
    computes_padding = True
    # Episodes go turn by turn where rollout.streaming=auto: with environments that answer at
    # once, a join's cache copy and prefill cost more than the waiting they save
    # (docs/design.md, "Multi-turn episodes").
    streams_by_default = False

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


class TurnCache:
    """The keys and values of one call's sequences, by their tokens, for the next turn.

    [Note: keys and values across turns]  (docs/design.md, "Multi-turn episodes")
    A turn's context is the last turn's context, its action and an observation. A key or value
    of a token depends only on the tokens before it and on its position, which generate counts
    from the attention mask over real tokens only: so a sequence's entries stay valid wherever
    its row is padded. ``continued`` lays each row out as its kept tokens (left-padded to the
    longest kept), then the tokens not kept (left-padded to the longest such run: holes in the
    middle, masked), and hands the decoding the kept entries as its cache, so the prefill
    computes only what is new. ``keep`` takes a row's entries as it ends (``Decoding``): those of
    its context and its response, less the last sampled token, which no step fed back. Only
    caches of plain dynamic layers are kept (a sliding window drops entries).
    """

    def __init__(self) -> None:
        # Tokens of a sequence -> per layer (key, value), each (heads, tokens, head size).
        self.entries: dict[tuple[int, ...], list[tuple[Tensor, Tensor]]] = {}

    def continued(self, part: PromptBatch, pad_token_id: int
                  ) -> tuple[Tensor, Tensor, Any | None]:
        """``part``'s rows laid out over their kept prefixes, and the cache of those (None, and
        ``part`` as it is, where no row continues a kept sequence)."""
        from transformers import DynamicCache

        rows = [ids[mask.bool()].tolist() for ids, mask in zip(part.input_ids,
                                                                part.attention_mask)]
        lengths = sorted({len(k) for k in self.entries}, reverse=True)
        # Each row's longest kept prefix, leaving it at least one token to feed.
        found = [next((k for k in lengths if k < len(row) and tuple(row[:k]) in self.entries), 0)
                 for row in rows]
        if not any(found):
            return part.input_ids, part.attention_mask, None
        kept, new = max(found), max(len(row) - k for row, k in zip(rows, found))
        ids = torch.full((len(rows), kept + new), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        sample = next(iter(self.entries.values()))
        layers = [(k.new_zeros(len(rows), k.shape[0], kept, k.shape[2]),
                   v.new_zeros(len(rows), v.shape[0], kept, v.shape[2])) for k, v in sample]
        for i, (row, k) in enumerate(zip(rows, found)):
            ids[i, kept - k:kept], ids[i, kept + new - (len(row) - k):] = (
                torch.tensor(row[:k]), torch.tensor(row[k:]))
            mask[i, kept - k:kept] = mask[i, kept + new - (len(row) - k):] = 1
            if k:
                for (keys, values), (key, value) in zip(layers, self.entries[tuple(row[:k])]):
                    keys[i, :, kept - k:], values[i, :, kept - k:] = key, value
        return ids, mask, DynamicCache(ddp_cache_data=layers)

    def keep(self, tokens: list[int], entries: list[tuple[Tensor, Tensor]]) -> None:
        """A sequence's ``tokens`` and its entries (per layer, each (heads, len(tokens), head
        size)): those of every token fed to the model, the last sampled one not among them."""
        self.entries[tuple(tokens)] = entries


def growing_cache(cache: Any | None, config: Any) -> Any:
    """A Hugging Face ``DynamicCache`` whose plain layers grow in place (``GrowingLayer``):
    ``cache``'s, its entries taken over, or (None) a new one of the layers the model's
    ``config`` names, as ``generate`` makes; a sliding-window layer stays as it is."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if cache is None:
        cache = DynamicCache(config=config.get_text_config(decoder=True))
    if cache.layer_class_to_replicate is DynamicLayer:  # layers made as the model first updates
        cache.layer_class_to_replicate = _growing_layer()
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            grown = _growing_layer()()
            if layer.is_initialized:
                grown.update(layer.keys, layer.values)
            cache.layers[i] = grown
    return cache


@functools.cache
def _growing_layer() -> type:
    """``GrowingLayer``, made on first use: this module imports no transformers until a call
    needs it."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A dynamic cache layer that writes each step's keys and values into room held ahead
        (doubled when full), where Hugging Face's concatenates: its step copied the whole
        cache, so a call's copying grew with the square of its length (a fifth of a small
        model's decoding step on the CPU). ``keys`` and ``values`` are views of the filled
        part."""

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.room: tuple[Tensor, Tensor] | None = None

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            filled, adding = self.get_seq_length(), key_states.shape[-2]
            if self.room is None or filled + adding > self.room[0].shape[-2]:
                size = max(2 * (filled + adding), 64)
                self.room = tuple(
                    new.new_empty(*new.shape[:-2], size, new.shape[-1])
                    for new in (key_states, value_states))
                for room, old in zip(self.room, (self.keys, self.values)):
                    if filled:
                        room[..., :filled, :] = old
            for room, new in zip(self.room, (key_states, value_states)):
                room[..., filled:filled + adding, :] = new
            self.keys, self.values = (room[..., :filled + adding, :] for room in self.room)
            return self.keys, self.values

        def stack(self, parts: list[tuple[Tensor, Tensor]], columns: int) -> None:
            """The layer as ``parts`` ((keys, values) of some rows each) one after another by
            rows, each right-aligned in ``columns`` (zeros before: masked columns)."""
            first = parts[0][0]
            self.lazy_initialization(first, parts[0][1])
            rows, size = sum(len(keys) for keys, _ in parts), max(2 * columns, 64)
            self.room = tuple(t.new_empty(rows, t.shape[1], size, t.shape[-1])
                              for t in parts[0])
            start = 0
            for part in parts:
                count, width = len(part[0]), part[0].shape[-2]
                for room, tensor in zip(self.room, part):
                    room[start:start + count, :, :columns - width] = 0
                    room[start:start + count, :, columns - width:columns] = tensor
                start += count
            self.keys, self.values = (room[..., :columns, :] for room in self.room)

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.room is not None:
                self.room = tuple(room.index_select(0, indices) for room in self.room)
                filled = self.get_seq_length()
                self.keys, self.values = (room[..., :filled, :] for room in self.room)

    return GrowingLayer


def _top_k(scores: Tensor, k: int) -> Tensor:
    """``scores`` with all but each row's ``k`` largest at -inf (0: none masked), as
    ``generate``'s top-k filter."""
    if not k:
        return scores
    kth = scores.topk(min(k, scores.shape[-1])).values[:, -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def _alike(one: Sampling, other: Sampling) -> bool:
    """Whether two requests' rows can decode together: they sample alike (their budgets may
    differ)."""
    return (one.greedy, one.temperature, one.top_k) == (other.greedy, other.temperature,
                                                        other.top_k)


_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values below 2^32, in int64:
    each product stays below 2^63, so no step overflows on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def seeded_tokens(logits: Tensor, sampling: Sampling, seeds: Tensor, counters: Tensor
                  ) -> Tensor:
    """A token per row of ``logits`` (B, V) drawn from ``softmax(top_k(logits / temperature))``
    with noise that is a pure function of the row's seed, its ``counters`` (the index of the
    token it draws) and the token id: the Gumbel-max draw ``argmax(log p + g)``, g = -log(-log
    u), u uniform in (0, 1) from a hash of the three (a counter-based stream, as JAX's
    ``random`` keys are). So a row draws the same tokens whatever rows decode beside it, and
    ``Decoding`` keeps no generator per row."""
    scores = _top_k(logits / sampling.temperature, sampling.top_k)
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    row = _mix32(_mix32(seeds & _MASK32) ^ (counters & _MASK32))
    bits = _mix32((row[:, None] + vocab[None, :] * 0x9E3779B9) & _MASK32)
    uniform = (bits.double() + 0.5) / 2.0 ** 32
    gumbel = -torch.log(-torch.log(uniform))
    return (scores.double().log_softmax(-1) + gumbel).argmax(-1)


def decode(lm: Any, ids: Tensor, mask: Tensor, cache: Any | None, sampling: Sampling,
           eos_token_id: int, pad_token_id: int, kept: TurnCache | None = None,
           seeds: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """Up to ``sampling.max_new_tokens`` tokens after each row of ``ids`` (left-padded, ``mask``
    its real tokens; ``cache`` the keys and values of its first columns, or None), through its
    first <eos>: (B, R) responses as wide as the longest, ``pad_token_id`` after each end, and
    (B, R) float32 log-probs of the sampled tokens under ``softmax(logits / temperature)``, the
    trainer's definition (None when greedy). ``kept``: each row's keys and values are kept
    there as it ends ([Note: keys and values across turns]). ``seeds``: each row samples from
    a stream of its own (``seeded_tokens``); None: from the process's (``Decoding``)."""
    decoding = Decoding(lm, sampling, eos_token_id, pad_token_id, kept)
    decoding.start(list(range(len(ids))), ids, mask, cache,
                   [sampling.max_new_tokens] * len(ids), seeds)
    ended: dict[int, tuple[list[int], list[float] | None]] = {}
    while decoding.running:
        ended.update((key, (tokens, logprobs)) for key, tokens, logprobs in decoding.step())
    width = max(len(tokens) for tokens, _ in ended.values())
    responses = ids.new_full((len(ids), width), pad_token_id)
    logprobs = None if sampling.greedy else torch.zeros(len(ids), width, device=ids.device)
    for row, (tokens, row_logprobs) in ended.items():
        responses[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if logprobs is not None:
            logprobs[row, :len(tokens)] = torch.tensor(row_logprobs)
    return responses, logprobs


# Ended rows leave the batch once they are 1 / DROP_SHARE of it ([Note: rows leave the batch as
# they end]).
DROP_SHARE = 4


class Decoding:
    """Rows that decode together on one key/value cache, each to its own end: its first <eos>
    or its own budget of tokens. Rows join (``start``) and leave between steps.

    [Note: rows leave the batch as they end]
    A row that has sampled its <eos> leaves the batch and the cache, so a step computes on the
    rows still running (and fewer than a third more: dropping rows copies the cache, so ended
    rows are dropped once they are a quarter of the batch, or when rows join). Hugging Face
    ``generate`` steps every row until the last ends, each ended one fed padding: on responses
    of varied lengths, most of the work of a step late in the call is on rows that have already
    ended. Without seeds, sampling is ``generate``'s: the logits divided by the temperature, all
    but the ``top_k`` likeliest masked (0: none), one draw of ``torch.multinomial`` over the
    batch's rows per step; while no row has ended, the draws are ``generate``'s own. With a seed
    per row, each row's draw is a pure function of its seed, its token's index and its logits
    (``seeded_tokens``): what else decodes beside it changes nothing but the rounding of its
    logits. Greedy rows take the likeliest token.
    """

    def __init__(self, lm: Any, sampling: Sampling, eos_token_id: int, pad_token_id: int,
                 kept: TurnCache | None = None) -> None:
        self.lm, self.sampling = lm, sampling
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.kept = kept
        # Per row: its key, its context's real tokens (Python lists); its response so far, the
        # log-probs of its tokens, their count, its most tokens, whether it has not ended, its
        # seed (tensors, (B, ...)).
        self.keys: list[Any] = []
        self.contexts: list[list[int]] = []
        self.tokens = self.logprobs = self.count = self.budget = self.live = None
        self.seeds: Tensor | None = None  # None: the process's stream
        self.cache: Any = None
        self.mask: Tensor | None = None  # (B, columns) of the cache
        self.last: Tensor | None = None  # (B,) the position of each row's last token
        self.logits: Tensor | None = None  # (B, V) float32: each row's next token's
        self.running = 0  # rows that have not ended
        # Rows' entries are kept (``kept``) where every layer is a plain one (no sliding window).
        self.keeps = False

    def start(self, keys: list[Any], ids: Tensor, mask: Tensor, cache: Any | None,
              budgets: list[int], seeds: list[int] | None) -> None:
        """Rows ``keys`` of ``ids`` (left-padded, ``mask``; ``cache`` the keys and values of
        their first columns, or None) prefilled: the only rows, or joined to those running."""
        device = ids.device
        cache = growing_cache(cache, self.lm.config)
        past = cache.get_seq_length()
        positions = position_ids(mask)  # the trainer's, for the trainer's log-probs
        out = self.lm(input_ids=ids[:, past:], attention_mask=mask,
                      position_ids=positions[:, past:], past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
        width = max(budgets)
        rows = {"tokens": ids.new_full((len(ids), width), self.pad_token_id),
                "logprobs": torch.zeros(len(ids), width, device=device),
                "count": torch.zeros(len(ids), dtype=torch.long, device=device),
                "budget": torch.tensor(budgets, dtype=torch.long, device=device),
                "live": torch.ones(len(ids), dtype=torch.bool, device=device),
                "seeds": None if seeds is None else torch.tensor(seeds, dtype=torch.long,
                                                                 device=device),
                "mask": mask, "last": positions[:, -1], "logits": out.logits[:, -1].float()}
        contexts = [ids[i][mask[i].bool()].tolist() for i in range(len(ids))]
        if self.cache is not None:
            if (self.seeds is None) != (seeds is None):
                raise ValueError("rows with seeds and rows without cannot decode together")
            self._merge(out.past_key_values, rows)
        else:
            self.cache = out.past_key_values
            for name, value in rows.items():
                setattr(self, name, value)
            self.keeps = self.kept is not None and all(
                type(layer) is _growing_layer() for layer in self.cache.layers)
        self.keys += keys
        self.contexts += contexts
        self.running += len(keys)

    def _merge(self, cache: Any, rows: dict[str, Any]) -> None:
        """Prefilled rows after the running ones (those ended dropped): both caches and masks
        left-padded to the wider's columns, then one batch; responses right-padded."""
        index = self.live.nonzero().squeeze(1)
        layers = [(layer.keys[index], layer.values[index]) for layer in self.cache.layers]
        self._select(index)
        columns = max(self.mask.shape[1], rows["mask"].shape[1])
        width = max(self.tokens.shape[1], rows["tokens"].shape[1])

        def left(tensor: Tensor, dim: int) -> Tensor:
            shape = list(tensor.shape)
            shape[dim] = columns - shape[dim]
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        def right(tensor: Tensor, fill: int) -> Tensor:
            return torch.cat([tensor, tensor.new_full(
                (len(tensor), width - tensor.shape[1]), fill)], dim=1)

        for i, (mine, theirs) in enumerate(zip(layers, cache.layers)):
            layer = _growing_layer()()
            layer.stack([mine, (theirs.keys, theirs.values)], columns)
            self.cache.layers[i] = layer
        self.mask = torch.cat([left(self.mask, 1), left(rows["mask"], 1)])
        self.tokens = torch.cat([right(self.tokens, self.pad_token_id),
                                 right(rows["tokens"], self.pad_token_id)])
        self.logprobs = torch.cat([right(self.logprobs, 0), right(rows["logprobs"], 0)])
        for name in ("logits", "count", "budget", "live", "seeds", "last"):
            if getattr(self, name) is not None:
                setattr(self, name, torch.cat([getattr(self, name), rows[name]]))

    def step(self) -> list[tuple[Any, list[int], list[float] | None]]:
        """One token of every running row; (key, response tokens, their log-probs or None when
        greedy) of each row that ended with it. The rows that go on are fed their token."""
        sampling, logits = self.sampling, self.logits
        if sampling.greedy:
            picked = logits.argmax(-1)
        elif self.seeds is not None:
            picked = seeded_tokens(logits, sampling, self.seeds, self.count)
        else:
            scores = _top_k(logits / sampling.temperature, sampling.top_k)
            picked = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
        at = self.live.nonzero().squeeze(1)
        self.tokens[at, self.count[at]] = picked[at]
        if not sampling.greedy:
            self.logprobs[at, self.count[at]] = (logits[at] / sampling.temperature).log_softmax(
                -1).gather(-1, picked[at, None]).squeeze(1)
        self.count[at] += 1
        ended = self.live & ((picked == self.eos_token_id) | (self.count == self.budget))
        self.live &= ~ended
        done = []
        for j in ended.nonzero().squeeze(1).tolist():
            self._keep(j)
            n = int(self.count[j])
            done.append((self.keys[j], self.tokens[j, :n].tolist(),
                         None if sampling.greedy else self.logprobs[j, :n].tolist()))
        self.running -= len(done)
        if not self.running:
            self.cache = None
            self.keys, self.contexts = [], []
            return done
        # Dropping rows copies the cache: done once a quarter of the batch has ended (at once
        # in a batch of up to 4); until then an ended row is fed padding, as generate does.
        if (len(self.keys) - self.running) * DROP_SHARE >= len(self.keys):
            picked = picked[self._drop_ended()]
        self._feed(picked)
        return done

    def _feed(self, picked: Tensor) -> None:
        """Each row's last token fed (padding for an ended row): the next token's logits."""
        tokens = picked.masked_fill(~self.live, self.pad_token_id)
        self.last = self.last + 1
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.keys), 1)], dim=1)
        out = self.lm(input_ids=tokens[:, None], attention_mask=self.mask,
                      position_ids=self.last[:, None], past_key_values=self.cache,
                      use_cache=True)
        self.logits = out.logits[:, -1].float()

    def abort(self, keys: set[Any]) -> dict[Any, tuple[list[int], list[float] | None]]:
        """Rows ``keys`` end now, out of the decoding; returns each one's response so far and
        its log-probs (None when greedy)."""
        taken = {}
        for j, key in enumerate(self.keys):
            if key in keys and bool(self.live[j]):
                self.live[j] = False
                self.running -= 1
                n = int(self.count[j])
                taken[key] = (self.tokens[j, :n].tolist(),
                              None if self.sampling.greedy else self.logprobs[j, :n].tolist())
        return taken

    def _drop_ended(self) -> Tensor:
        """The ended rows out of the batch and the cache; returns the rows kept (as they were
        numbered)."""
        index = self.live.nonzero().squeeze(1)
        if len(index) == len(self.keys):
            return index
        self.cache.batch_select_indices(index)
        self._select(index)
        return index

    def _select(self, index: Tensor) -> None:
        """Every row's state but the cache's, of rows ``index`` only."""
        for name in ("mask", "last", "logits", "tokens", "logprobs", "count", "budget", "live",
                     "seeds"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[index])
        keep = index.tolist()
        self.keys = [self.keys[j] for j in keep]
        self.contexts = [self.contexts[j] for j in keep]

    def _keep(self, j: int) -> None:
        """Row ``j``'s keys and values, kept by its tokens: its context and every response
        token fed (all but the last sampled)."""
        if not self.keeps:
            return
        width = self.mask.shape[1]
        fed = int(self.count[j]) - 1
        cols = self.mask[j, :width - fed].nonzero().squeeze(-1)
        cols = torch.cat([cols, torch.arange(width - fed, width, device=cols.device)])
        self.kept.keep(self.contexts[j] + self.tokens[j, :fed].tolist(),
                       [(layer.keys[j][:, cols], layer.values[j][:, cols])
                        for layer in self.cache.layers])


def sampled_logprobs(logits: tuple[Tensor, ...], responses: Tensor, temperature: float
                     ) -> Tensor:
    """(B, R) float32 log-probs of the sampled ``responses`` under ``softmax(logits /
    temperature)``: ``logits`` are generate's raw ones (before top-k and the temperature), one
    (B, V) per step, so this is the trainer's definition (``models.CausalLM``) and in fp32 the
    two differ only by the key/value-cache path of the computation."""
    # At most eight slices of steps, a handful of kernels each rather than per step: a slice's
    # (B, k, V) float32 holds an eighth of the steps whose logits generate keeps.
    k = -(-len(logits) // 8)
    return torch.cat([torch.stack(logits[i:i + k], dim=1).float().div(temperature)
                      .log_softmax(-1).gather(-1, responses[:, i:i + k, None]).squeeze(-1)
                      for i in range(0, len(logits), k)], dim=1)


# Its replicas take a LoRA actor's adapters on any device (``HFReplica.sync_adapters``).
@register_engine("hf", check=check, needs_sync=HFRollout.needs_sync, adapters=lambda cfg: None)
def _hf(context: EngineContext) -> HFRollout:
    return HFRollout(context.engine, context.pad_token_id, context.eos_token_id, context.device,
                     context.cfg.rollout.micro_batch_size,
                     static_decode(context.cfg, context.engine.module.lm, context.device))


class LocalWeights:
    """A rollout replica's own copy of the actor's model, as the hf engine reads an engine's
    weights (``gathered``), loaded by Hugging Face name from the actor's (``load``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        # Hugging Face names, a tied weight once (what the actor sends: models.hf_weights).
        self.params = dict(module.lm.named_parameters())

    def gathered(self, phase: str | None = None) -> ContextManager:
        return contextlib.nullcontext(self.module)

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        for name, tensor in named:
            self.params[name].copy_(tensor)


class HFReplica(HFRollout):
    """The hf engine of a rollout replica on a device of its own: it generates on its own copy
    of the weights (``LocalWeights``), which ``sync`` overwrites after each update, or, for a
    LoRA actor, into which ``sync_adapters`` merges the adapters (``lora_scale``: alpha / r)."""

    needs_sync = True

    def __init__(self, *args: Any, lora_scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lora_scale = lora_scale
        # Each adapted linear's base weight as ``sync`` loaded it, kept from the first
        # ``sync_adapters`` on: every merge starts from it, as the actor's merged sync does, so
        # both give the same weights to the bit.
        self._base: dict[str, Tensor] = {}

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._base.clear()
        self.engine.load(named_tensors)

    @torch.no_grad()
    def sync_adapters(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Each adapted linear's weight, W + alpha / r B A (``models.lora_merged``), once both
        of its factors have come."""
        factors: dict[str, dict[str, Tensor]] = {}
        params = self.engine.params
        for name, tensor in named_tensors:
            linear, piece, _ = name.rsplit(".", 2)
            pieces = factors.setdefault(linear, {})
            pieces[piece] = tensor.detach().clone()
            if len(pieces) < 2:
                continue
            weight = f"{linear}.weight"
            if linear not in self._base:
                self._base[linear] = params[weight].detach().clone()
            params[weight].copy_(lora_merged(self._base[linear], pieces["lora_A"],
                                             pieces["lora_B"], self.lora_scale))
            del factors[linear]
        assert not factors, f"adapted linears without both factors: {sorted(factors)}"
