"""The ``hf`` rollout engine: Hugging Face ``generate`` on the actor's own parameters, gathered
once for the whole rollout (phase ``generate`` of the actor's meter)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable, Iterator

import torch
from torch import Tensor

from rlhf_paro.comm.meter import GENERATE
from rlhf_paro.config import Config, ConfigError
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
        # Inside turns() (dynamic cache only): the keys and values of the last call's sequences,
        # which the next turn's contexts continue.
        self.kept: TurnCache | None = None

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, sampling: Sampling) -> RolloutBatch:
        """Each chunk stops when its every row has ended, so its responses are as wide as its
        own longest; the chunks are then joined as wide as the rank's longest."""
        kwargs = ({"do_sample": False} if sampling.greedy else
                  {"do_sample": True, "temperature": sampling.temperature,
                   "top_k": sampling.top_k})
        if self.static is not None:
            kwargs.update(self.static.kwargs())
        size = self.micro_batch_size or len(prompts)
        chunks = []
        kept = None if self.kept is None else TurnCache()
        with self.engine.gathered(phase=GENERATE) as model:
            model.eval()
            for start in range(0, len(prompts), size):
                part = prompts.select(slice(start, start + size))
                ids, mask, cache = (part.input_ids, part.attention_mask, None)
                if self.kept is not None:
                    ids, mask, cache = self.kept.continued(part, self.pad_token_id)
                # use_cache: a model configured without one still decodes on one (and keeps it).
                # inference_mode: a decoding step's tensors get no version counter or view
                # tracking, which no_grad still keeps (about 5% of a small batch's step on the
                # CPU, where a step is dispatcher-bound). Nothing generate returns is written in
                # place or saved for a backward: join copies the rows out of it.
                with torch.inference_mode():
                    out = model.generate(ids.to(self.device), mask.to(self.device),
                                         max_new_tokens=sampling.max_new_tokens,
                                         pad_token_id=self.pad_token_id,
                                         eos_token_id=self.eos_token_id,
                                         return_dict_in_generate=True, use_cache=True,
                                         output_logits=not sampling.greedy, **kwargs,
                                         **({} if cache is None else {"past_key_values": cache}))
                responses = out.sequences[:, ids.shape[1]:]
                batch = join(part, responses.cpu(), self.eos_token_id, None if sampling.greedy
                             else sampled_logprobs(out.logits, responses,
                                                   sampling.temperature).cpu())
                if kept is not None:
                    kept.keep(ids, mask, batch, out.past_key_values)
                chunks.append(batch)
        if kept is not None:
            self.kept = kept  # the next turn continues this call's sequences, none before
        return chunks[0] if len(chunks) == 1 else RolloutBatch.concat(chunks, self.pad_token_id)

    @contextlib.contextmanager
    def turns(self) -> Iterator[None]:
        """The weights gathered once for all turns (``generate`` inside it gathers nothing:
        ``engine.gathered`` nests) and, on the dynamic cache, each sequence's keys and values
        kept from one turn to the next ([Note: keys and values across turns])."""
        with self.engine.gathered(phase=GENERATE):
            self.kept = TurnCache() if self.static is None else None
            try:
                yield
            finally:
                self.kept = None

    # Generation reads the engine's own parameters, gathered at each call: there is no second copy
    # of the weights to update, and nothing held between calls to release.
    needs_sync = False
    # One static batch per chunk: every row computed on as wide as the chunk's longest, its
    # prompt's left padding and the positions after its end included.
    computes_padding = True

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
    middle, masked), and hands generate the kept entries as its cache, so the prefill computes
    only what is new. ``keep`` takes from generate's cache the entries of each row's real tokens:
    its context and its response through its end, less the last sampled token, which no step fed
    back. Only caches of plain dynamic layers are kept (a sliding window drops entries).
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

    def keep(self, ids: Tensor, mask: Tensor, batch: RolloutBatch, cache: Any) -> None:
        """The entries of ``batch``'s sequences, generated from ``ids``/``mask`` (the layout
        generate was given) with ``cache`` as generate left it."""
        from transformers.cache_utils import DynamicLayer

        if cache is None or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return
        width = cache.get_seq_length()
        for i in range(len(ids)):
            ended = int(batch.action_mask[i].sum())
            cols = torch.cat([mask[i].nonzero().squeeze(-1),
                              ids.shape[1] + torch.arange(min(ended, width - ids.shape[1]))])
            tokens = ids[i, cols[cols < ids.shape[1]]].tolist() + \
                batch.responses[i, :len(cols) - int(mask[i].sum())].tolist()
            cols = cols.to(cache.layers[0].keys.device)
            self.entries[tuple(tokens)] = [(layer.keys[i][:, cols], layer.values[i][:, cols])
                                           for layer in cache.layers]


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


@register_engine("hf", check=check, needs_sync=HFRollout.needs_sync)
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
    of the weights (``LocalWeights``), which ``sync`` overwrites after each update."""

    needs_sync = True

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.engine.load(named_tensors)
