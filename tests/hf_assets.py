"""Tiny Hugging Face models, tokenizers and prompt files a new user would bring, built in code.

Nothing is downloaded: the tokenizers are trained here with the ``tokenizers`` library on the
words of the prompts, the models are random and saved with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SYMBOLS = [chr(ord("a") + k) for k in range(16)]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def _corpus() -> list[str]:
    return [" ".join(SYMBOLS[i:] + SYMBOLS[:i]) + " count : user assistant system"
            for i in range(len(SYMBOLS))]


def word_tokenizer(chat: bool = True):
    """A word-level tokenizer with <pad>, <s> (prepended), </s> and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def bpe_tokenizer():
    """A byte-level BPE tokenizer (as GPT-2's) with only an eos token: pad falls back to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")


def llama_config(vocab_size: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, **extra)


def save_llama(directory: Path, tokenizer, seed: int = 0, layers: int = 2) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(len(tokenizer))
    config.num_hidden_layers = layers
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_gpt2(directory: Path, tokenizer, seed: int = 0) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2,
                               n_head=4, bos_token_id=eos, eos_token_id=eos)
                    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_reward(directory: Path, tokenizer, seed: int = 0) -> Path:
    """A Llama sequence classifier with one label, as TRL and OpenRLHF save reward models."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(llama_config(len(tokenizer), num_labels=1))
    with torch.no_grad():  # a visible score: random heads of this size score near 0
        model.score.weight.normal_(std=1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_prompts(path: Path, num: int, chat: bool = False, seed: int = 0) -> Path:
    """``num`` counting prompts of 1 to 6 symbols (mixed lengths), with a ``start`` column;
    ``chat``: each prompt a list of messages."""
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(num):
            start = int(torch.randint(0, 16, (1,), generator=gen))
            length = int(torch.randint(1, 7, (1,), generator=gen))
            text = "count : " + " ".join(SYMBOLS[(start + k) % 16] for k in range(length))
            prompt = [{"role": "user", "content": text}] if chat else text
            f.write(json.dumps({"prompt": prompt, "start": start}) + "\n")
    return path


REWARD_FUNCTIONS = '''
def length(prompts, responses, start):
    assert len(start) == len(prompts)
    return [float(len(r.split())) / 8 for r in responses]

def broken(prompts, responses, **columns):
    raise ValueError("no score for you")

def short(prompts, responses, **columns):
    return [0.0]
'''


def write_reward_functions(path: Path) -> Path:
    path.write_text(REWARD_FUNCTIONS)
    return path
