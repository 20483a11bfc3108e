"""A user's model folder is checked for what it holds, not for whether loading raised.

    no tokenizer   a Qwen2 folder without tokenizer files: AutoTokenizer raises nothing and
                   gives an empty Qwen2Tokenizer that encodes any text as [], and the run said
                   "data.train_files: ... row 1: an empty prompt": the user looked in the
                   prompts file
    as saved       a Qwen2 folder whose tokenizer.json is word-level: AutoTokenizer builds the
                   model type's class from its vocabulary, which encodes "w1 w2 w3" as [] where
                   the file says [4, 15, 16] (the same files beside a Llama config load as saved)
    no weights     a folder with config.json and no weights: it failed in every worker's
                   from_pretrained, after Ray and the engines had started
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf_paro.config import ConfigError
from rlhf_paro.ppo.data import load_tokenizer
from tests import hf_assets

WORDS = [f"w{i}" for i in range(20)]


def _word_level():
    """A word-level tokenizer of the words w0..w19, as a user may train one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(
        special_tokens=["<pad>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = hf_assets.CHAT_TEMPLATE
    return fast


def _qwen2(directory, tokenizer=None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=23, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _weightless_llama(directory):
    """A Llama folder whose tokenizer is fine and whose weights were never saved."""
    tokenizer = hf_assets.word_tokenizer()
    hf_assets.llama_config(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    words = _word_level()
    return {"saved": _qwen2(root / "saved", words), "bare": _qwen2(root / "bare"),
            "weightless": _weightless_llama(root / "weightless"),
            "prompts": hf_assets.write_prompts(root / "prompts.jsonl", 4)}


def test_a_folder_s_own_tokenizer_json_is_used_as_saved(folders):
    tokenizer = load_tokenizer(str(folders["saved"]), key="actor.path")
    assert tokenizer("w1 w2 w3", add_special_tokens=False)["input_ids"] == [4, 15, 16]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("</s>", "<pad>")
    assert tokenizer.chat_template == hf_assets.CHAT_TEMPLATE
    assert tokenizer.padding_side == "left"


def test_a_tokenizer_that_encodes_nothing_is_one_line_naming_the_folder(folders):
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(folders["bare"]), key="actor.path")
    assert str(err.value) == (
        f"actor.path: the tokenizer of {str(folders['bare'])!r} encodes a plain sentence as no "
        "tokens (no tokenizer.json or tokenizer_config.json there); allowed: a directory with "
        "the tokenizer saved by save_pretrained")


def _train(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "rlhf_paro.train", "conf=grpo_tiny",
                           "cluster.num_devices=1", "cluster.group_size=1", *args,
                           f"trainer.output_dir={tmp_path / 'out'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("folder, says", [
    ("bare", "actor.path: the tokenizer of {path!r} encodes a plain sentence as no tokens"),
    ("weightless", "actor.path: {path!r} has a config.json but no weights "
                   "(model*.safetensors, pytorch_model*.bin); allowed: a directory saved by "
                   "save_pretrained, weights included"),
])
def test_a_folder_without_a_tokenizer_or_weights_is_named_before_anything_starts(
        folders, tmp_path, folder, says):
    path = folders[folder]
    proc = _train(tmp_path, f"actor.path={path}", f"data.train_files={folders['prompts']}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("error: " + says.format(path=str(path))), line
    assert not (tmp_path / "out").exists()
