"""The ``hf`` rollout engine: Hugging Face ``generate`` on the actor's own parameters, gathered
once for the whole rollout (phase ``generate`` of the actor's meter)."""

from __future__ import annotations

from typing import ContextManager, Iterable

import torch
from torch import Tensor

from rlhf_paro.comm.meter import GENERATE
from rlhf_paro.rollout.base import EngineContext, Sampling, register_engine
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch, join


class HFRollout:
    """Generates with the actor's model under ``engine.gathered()``, ``micro_batch_size``
    prompts at a time (None: all at once): the key/value cache of one chunk is what it holds."""

    def __init__(self, engine: object, pad_token_id: int, eos_token_id: int,
                 device: torch.device, micro_batch_size: int | None = None) -> None:
        self.engine = engine
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = device
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, sampling: Sampling) -> RolloutBatch:
        """Each chunk stops when its every row has ended, so its responses are as wide as its
        own longest; the chunks are then joined as wide as the rank's longest."""
        kwargs = ({"do_sample": False} if sampling.greedy else
                  {"do_sample": True, "temperature": sampling.temperature,
                   "top_k": sampling.top_k})
        size = self.micro_batch_size or len(prompts)
        chunks = []
        with self.engine.gathered(phase=GENERATE) as model:
            model.eval()
            for start in range(0, len(prompts), size):
                part = prompts.select(slice(start, start + size))
                out = model.generate(part.input_ids.to(self.device),
                                     part.attention_mask.to(self.device),
                                     max_new_tokens=sampling.max_new_tokens,
                                     pad_token_id=self.pad_token_id,
                                     eos_token_id=self.eos_token_id,
                                     return_dict_in_generate=True,
                                     output_logits=not sampling.greedy, **kwargs)
                responses = out.sequences[:, part.input_ids.shape[1]:]
                logp = None if sampling.greedy else sampled_logprobs(
                    out.logits, responses, sampling.temperature).cpu()
                chunks.append(join(part, responses.cpu(), self.eos_token_id, logp))
        return chunks[0] if len(chunks) == 1 else RolloutBatch.concat(chunks, self.pad_token_id)

    def turns(self) -> ContextManager:
        """The weights gathered once for all turns: ``generate`` inside it gathers nothing
        (``engine.gathered`` nests)."""
        return self.engine.gathered(phase=GENERATE)

    # Generation reads the engine's own parameters, gathered at each call: there is no second copy
    # of the weights to update, and nothing held between calls to release.
    needs_sync = False

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


def sampled_logprobs(logits: tuple[Tensor, ...], responses: Tensor, temperature: float
                     ) -> Tensor:
    """(B, R) float32 log-probs of the sampled ``responses`` under ``softmax(logits /
    temperature)``: ``logits`` are generate's raw ones (before top-k and the temperature), one
    (B, V) per step, so this is the trainer's definition (``models.CausalLM``) and in fp32 the
    two differ only by the key/value-cache path of the computation."""
    # Step by step: one (B, V) float32 at a time next to the logits generate keeps.
    return torch.stack([step.float().div(temperature).log_softmax(-1)
                        .gather(-1, token.unsqueeze(-1)).squeeze(-1)
                        for step, token in zip(logits, responses.T)], dim=1)


@register_engine("hf", needs_sync=HFRollout.needs_sync)
def _hf(context: EngineContext) -> HFRollout:
    return HFRollout(context.engine, context.pad_token_id, context.eos_token_id, context.device,
                     context.cfg.rollout.micro_batch_size)
