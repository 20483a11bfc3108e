"""Shared pieces of the engine tests: tiny models, batches, and the unsharded references.

The fp32 reference is the unsharded model trained on the *global* batch: for every step, all N
ranks' s micro-batches, loss = mean of the N*s micro-batch losses, ``clip_grad_norm_`` and
``torch.optim.AdamW``. The sharded run must reproduce every micro-batch loss of every rank at every
step and the final parameters.

The bf16 reference (``bf16_shadow``) follows the sharded run instead of running on its own, so
that its tolerance can be derived: see [Note: bf16 error bound].
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Iterator

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

# bf16_reduce: bf16 weights with gradient reductions in bf16 (Table 3's traffic) instead of fp32.
# ckpt_hooks_inside: each block under a reentrant checkpoint that runs the module's hooks inside
# it, as some transformers releases checkpoint (5.19: the layer's __call__, not its forward).
VARIANTS = ("base", "odd", "tied", "lora", "ckpt", "ckpt_reentrant", "ckpt_hooks_inside", "bf16",
            "bf16_reduce")


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
        return "bf16" if self.variant.startswith("bf16") else "fp32"

    @property
    def reduce_dtype(self) -> str:
        return "bf16" if self.variant == "bf16_reduce" else "fp32"

    @property
    def bucket_numel(self) -> int:
        """Half the grid reduces every unit's gradient alone (1: the path of any unit of a real
        model's size), the other half in buckets (the default: these units are all small)."""
        from rlhf_paro.sharding.schedule import BUCKET_NUMEL

        alone = self.comm != "native" or self.variant in ("odd", "tied", "ckpt", "bf16")
        return 1 if alone else BUCKET_NUMEL


class TwoLayer(nn.Module):
    """The smallest model: no blocks, so the engine makes it one root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum()


def _hooks_inside(cls: type) -> type:
    """``cls`` whose calls run, hooks and all, under a reentrant checkpoint: the engine's
    pre-forward and post-forward hooks see the first pass without gradients and run again in
    the recomputation inside backward."""

    class HooksInside(cls):
        def __call__(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                functools.partial(nn.Module.__call__, self, **kwargs), *args, use_reentrant=True)

    # The engine finds its units by class name (the model's _no_split_modules).
    HooksInside.__name__ = HooksInside.__qualname__ = cls.__name__
    return HooksInside


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
    if variant == "ckpt_hooks_inside":
        for layer in model.model.layers:
            layer.__class__ = _hooks_inside(type(layer))
    elif variant.startswith("ckpt"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": variant == "ckpt_reentrant"})
    if variant.startswith("bf16"):
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    model.train()
    return model


def make_batches(variant: str, world_size: int, seed: int = 1, steps: int = STEPS) -> torch.Tensor:
    """Token ids of shape (steps, N, MICRO, BATCH, SEQ)."""
    vocab = 37 if variant == "odd" else 32
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, world_size, MICRO, BATCH, SEQ), generator=gen)


def micro_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference_run(variant: str, world_size: int, steps: int = STEPS,
                  skip: frozenset[int] = frozenset()) -> dict:
    """Unsharded fp32 training on the global batch; losses (steps, N, MICRO), norms, final state.
    The optimizer does not step at the steps in ``skip`` (their gradients are dropped)."""
    assert not variant.startswith("bf16"), "bf16 runs are held to bf16_shadow"
    model = build_model(variant)
    batches = make_batches(variant, world_size, steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **OPTIM)
    losses = torch.zeros(steps, world_size, MICRO, dtype=torch.float64)
    norms = []
    for step in range(steps):
        for r in range(world_size):
            for k in range(MICRO):
                loss = micro_loss(model, batches[step, r, k])
                losses[step, r, k] = loss.item()
                (loss / (world_size * MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        if step not in skip:
            opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}


# [Note: bf16 error bound]
# Two bf16 runs that add the same numbers in another order drift apart chaotically: a master
# weight that moves by 1e-9 can round to the neighbouring bf16 value, and from then on the two
# runs see different weights. So the bf16 reference does not train on its own; at every step it
# starts from the sharded run's own bf16 weights theta_t and does what the engine should:
#   1. losses. Same bf16 weights, same inputs, same kernels, one thread each, and the weights
#      laid out in flat buffers at the engine's offsets (so that no kernel picks another path
#      for another alignment): the micro-batch losses, and the bf16 gradients of each
#      micro-batch, are bit-identical. Bound: 0.
#   2. summed gradient. The engine widens each micro-batch gradient to fp32, divides by N and
#      adds the n = N*s of them in fp32 (accumulator and fp32 reductions) in an order of its own.
#      Any order of n terms is within gamma(n-1)*sum|g_i| of the exact sum (Higham, "Accuracy
#      and Stability of Numerical Algorithms", 2nd ed., eq. 4.4), so the two sums differ by at
#      most e = 2*gamma(n-1)*sum|g_i|, element by element, plus u*sum|g_i| for the division.
#      With bf16 reductions, every addition, cast and division on the engine's side rounds to
#      bf16 at worst: e = (gamma_bf16(n+2) + gamma(n-1) + u)*sum|g_i|.
#   3. norm and clipping. |norm_sharded - norm_ref| <= ||e|| + gamma(d+2)*(2*||g|| + ||e||)
#      for d elements (a sum of d squares and a square root, each side); the clipping
#      coefficient min(1, c/(norm + 1e-6)) moves by at most c*dnorm/(norm - dnorm + 1e-6)**2,
#      plus u for its own rounding on each side.
#   4. AdamW on fp32 masters. Bias-corrected m and sqrt(v) are weighted means (weights summing
#      to 1) of the clipped gradients and of their squares, so each moves by at most E, the
#      largest clipped-gradient error so far. With a = sqrt(v) + eps, the update m/a moves by at
#      most E*(1 + |m|/a)/(a - E) (when a > E; otherwise by 2*C_t, twice the largest |m|/sqrt(v)
#      by Cauchy-Schwarz). The master bound grows as
#      delta <- delta*|1 - lr*wd| + lr*du + 16u*(|master| + lr*C_t), the last term the fp32
#      rounding of both runs' updates.
#   5. bf16 weights. The sharded weight is its master rounded to bf16 (relative error at most
#      2**-8), so |theta_sharded - master_ref| <= delta + 2**-8*(|master_ref| + delta).
# Every quantity in the bound is computed from this run's data; nothing is read off a machine.
U32 = 2.0 ** -24  # unit roundoff of fp32
U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits)


def gamma(k: int, u: float = U32) -> float:
    return k * u / (1 - k * u)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The sharded ranks run one thread each; so must the shadow, for bit-identical kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bf16_shadow(states: list[dict], world_size: int, reduce_dtype: str = "fp32") -> list[dict]:
    """Per step t: the reference losses (N, MICRO) and gradient norm at the sharded weights
    ``states[t]``, the bound on the sharded norm, and the reference fp32 masters after the step
    with the element-wise bound on the sharded bf16 weights ``states[t + 1]`` (the steps of the
    [Note: bf16 error bound])."""
    with _one_thread():
        return _bf16_shadow(states, world_size, reduce_dtype)


def _flat_like_the_engine(model: nn.Module, world_size: int) -> None:
    """Make each unit's trainable parameters views into one flat buffer, at the offsets the
    engine gives them (``sharding/_flat.py``)."""
    from rlhf_paro.sharding.layout import padded, split_units

    for unit in split_units(model):
        params = [p for p in unit.params if p.requires_grad]
        total = sum(p.numel() for p in params)
        flat = torch.zeros(padded(total, world_size), dtype=params[0].dtype)
        offset = 0
        for p in params:
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()


def _bf16_shadow(states: list[dict], world_size: int, reduce_dtype: str) -> list[dict]:
    model = build_model("bf16")
    _flat_like_the_engine(model, world_size)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, **OPTIM)
    lr, wd, eps = OPTIM["lr"], OPTIM["weight_decay"], OPTIM["eps"]
    b1, b2 = OPTIM["betas"]
    batches = make_batches("bf16", world_size)
    n = world_size * MICRO
    d = sum(p.numel() for p in params)
    delta = [torch.zeros_like(m, dtype=torch.float64) for m in masters]
    worst = [torch.zeros_like(m, dtype=torch.float64) for m in masters]  # E so far
    out = []
    for step in range(STEPS):
        model.load_state_dict(states[step])
        losses = torch.zeros(world_size, MICRO, dtype=torch.float64)
        acc = [torch.zeros_like(m) for m in masters]
        abs_sum = [torch.zeros_like(m, dtype=torch.float64) for m in masters]
        for r in range(world_size):
            for k in range(MICRO):
                loss = micro_loss(model, batches[step, r, k])
                losses[r, k] = loss.item()
                (loss / MICRO).backward()  # what engine.backward does
                for a, s, p in zip(acc, abs_sum, params):
                    g = p.grad.float() / world_size
                    a.add_(g)
                    s.add_(g.double().abs())
                    p.grad = None
        if reduce_dtype == "fp32":  # step 2
            rel = 2 * gamma(n - 1) + U32
        else:
            rel = gamma(n + 2, U_BF16) + gamma(n - 1) + U32
        e = [rel * s for s in abs_sum]
        exact = math.sqrt(sum(float(a.double().pow(2).sum()) for a in acc))
        e_norm = math.sqrt(sum(float(x.pow(2).sum()) for x in e))
        norm_bound = e_norm + gamma(d + 2) * (2 * exact + e_norm)  # step 3
        norm = torch.stack([a.pow(2).sum() for a in acc]).sum().sqrt()  # fp32, as the engine
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        low = max(float(norm) - 2 * norm_bound, 0.0)
        d_coef = MAX_NORM * 2 * norm_bound / (low + 1e-6) ** 2 + 2 * U32 * float(coef)
        c = float(coef)
        for m, a, ei, w in zip(masters, acc, e, worst):
            m.grad = a * coef
            mag = a.double().abs() + ei
            w.copy_(torch.maximum(w, c * ei + d_coef * mag + 2 * U32 * (c + d_coef) * mag))
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = step + 1  # step 4
        w1 = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
        w2 = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
        c_t = math.sqrt(sum(x * x / y for x, y in zip(w1, w2)))
        bounds = {}
        for name, m, dl, big_e in zip(names, masters, delta, worst):
            state = opt.state[m]
            m_hat = state["exp_avg"].double() / (1 - b1 ** t)
            a = (state["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt() + eps
            du = torch.where(a > big_e, big_e * (1 + m_hat.abs() / a) / (a - big_e).clamp_min(1e-300),
                             torch.full_like(a, 2 * c_t))
            master = m.detach().double()
            dl.mul_(abs(1 - lr * wd)).add_(lr * du + 16 * U32 * (master.abs() + lr * c_t))
            bounds[name] = (master.clone(), dl + U_BF16 * (master.abs() + dl))  # step 5
        out.append({"losses": losses, "norm": float(norm), "norm_bound": norm_bound,
                    "weights": bounds})
    return out
