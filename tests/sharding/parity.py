"""Shared pieces of the engine parity tests: tiny models, batches, and the unsharded reference.

The reference is the unsharded model trained on the *global* batch: for every step, all N ranks'
s micro-batches, loss = mean of the N*s micro-batch losses, ``clip_grad_norm_`` and
``torch.optim.AdamW``. The sharded run must reproduce every micro-batch loss of every rank at every
step and the final parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STEPS = 3
MICRO = 2  # s, micro-batches per optimizer step
BATCH, SEQ = 2, 8
# A large learning rate and a small clipping threshold, so that both visibly act. eps = 1e-6
# keeps Adam from dividing gradients that cancel to rounding noise by their own size, which
# would turn a summation-order difference of 1e-12 into a parameter difference of 1e-6.
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
MAX_NORM = 0.01  # below every variant's gradient norm (LoRA's is about 0.02)

VARIANTS = ("base", "odd", "tied", "lora", "ckpt", "ckpt_reentrant", "bf16")


@dataclass(frozen=True)
class Case:
    strategy: str
    variant: str = "base"
    comm: str = "native"

    @property
    def key(self) -> str:
        return f"{self.strategy}-{self.variant}-{self.comm}"

    @property
    def precision(self) -> str:
        return "bf16" if self.variant == "bf16" else "fp32"


def build_model(variant: str, seed: int = 0) -> nn.Module:
    """A tiny Hugging Face Llama. ``odd`` has unit sizes that N=4 does not divide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # odd: blocks of 354 and a root of 450 elements, neither a multiple of 4.
    hidden, inter, vocab, heads = (6, 11, 37, 1) if variant == "odd" else (8, 16, 32, 2)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=variant == "tied",
                         use_cache=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
        # peft starts B at zero; perturb it so that every LoRA weight gets a gradient at step 1.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    if variant.startswith("ckpt"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": variant == "ckpt_reentrant"})
    if variant == "bf16":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    model.train()
    return model


def make_batches(variant: str, world_size: int, seed: int = 1) -> torch.Tensor:
    """Token ids of shape (STEPS, N, MICRO, BATCH, SEQ)."""
    vocab = 37 if variant == "odd" else 32
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (STEPS, world_size, MICRO, BATCH, SEQ), generator=gen)


def micro_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference_run(variant: str, world_size: int) -> dict:
    """Unsharded training on the global batch; losses (STEPS, N, MICRO), norms and final state."""
    model = build_model(variant)
    batches = make_batches(variant, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    bf16 = variant == "bf16"
    # In bf16 the optimizer steps fp32 masters, as the engine does (Table 2's K = 12).
    masters = [p.detach().float().clone().requires_grad_(True) for p in params] if bf16 else params
    opt = torch.optim.AdamW(masters, **OPTIM)
    losses = torch.zeros(STEPS, world_size, MICRO, dtype=torch.float64)
    norms = []
    for step in range(STEPS):
        for r in range(world_size):
            for k in range(MICRO):
                loss = micro_loss(model, batches[step, r, k])
                losses[step, r, k] = loss.item()
                (loss / (world_size * MICRO)).backward()
        if bf16:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}
