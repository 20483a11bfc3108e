"""Multi-turn episodes through the actor (``rollout/episodes.py``) on both engines, against a
deterministic environment: the same greedy episodes token for token from ``hf`` and ``vllm``,
observations attended and never actions, and each engine's log-probs of its sampled actions
within 1e-4 of the trainer's (docs/design.md, "Multi-turn episodes"). The hf engine's checks run
without vLLM; each engine is the actor's own, built with its model as a run builds it."""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.rollout import vllm as vllm_engine
from tests.confs import load
from tests.dist_utils import run_distributed
from tests.hf_assets import SYMBOLS, word_tokenizer, write_prompts

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Answers each action with the two symbols after its last one (an <unk>-free observation of two
# tokens), rewards the action's length; the episode is done after the third action.
RELAY = f'''
SYMBOLS = {SYMBOLS!r}

class Relay:
    def __init__(self, prompt, start):
        self.turn, self.start = 0, start

    def reset(self):
        return None

    def step(self, action):
        self.turn += 1
        words = [w for w in action.split() if w in SYMBOLS]
        last = SYMBOLS.index(words[-1]) if words else self.start
        observation = " ".join(SYMBOLS[(last + k) % 16] for k in (1, 2))
        return observation, len(action.split()) / 8, self.turn == 3
'''
NEW_TOKENS = 5
ROWS = 12


def _model(directory):
    """A random Llama with heads of 32 (vLLM's CPU attention takes none smaller), saved with a
    word-level tokenizer as a user's model is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(chat=False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _argv(tmp, engine: str) -> list[str]:
    return [f"actor.path={tmp / 'model'}", f"data.train_files={tmp / 'prompts.jsonl'}",
            f"env.function={tmp / 'relay.py'}:Relay", "env.reward=env", "env.max_turns=4",
            "reward.path=null", "cluster.num_devices=1", "cluster.group_size=1",
            "actor.strategy=NNN", f"rollout.engine={engine}", "rollout.n=1",
            "algorithm.adv_estimator=reinforce_pp", "algorithm.kl_coef=0",
            f"ppo.rollout_batch_size={ROWS}", f"ppo.mini_batch_size={ROWS}",
            f"ppo.max_new_tokens={NEW_TOKENS}", "ppo.temperature=0.8", "data.max_prompt_length=12"]


def _rank(rank: int, world_size: int, tmp, engine: str) -> dict:
    """The actor with the rollout engine ``engine`` (built with its model, as a run builds it):
    greedy episodes, sampled ones, and its log-probs against the trainer's."""
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.runs import Prompts

    cfg = load(_argv(tmp, engine))
    actor = ActorWorker(cfg, "actor", rank, world_size)
    actor.shard_model()
    prompts = Prompts(cfg, None)
    per_rank, rows = prompts.split(prompts.stream.next(ROWS))
    greedy, stats = actor.generate(per_rank[0], rows[0], greedy=True, step=0)
    sampled, _ = actor.generate(per_rank[0], rows[0], step=1)
    return {"greedy": greedy, "stats": stats, "sampled": sampled, "diff": actor.old_logprobs()}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("episodes")
    _model(tmp / "model")
    write_prompts(tmp / "prompts.jsonl", 32)
    (tmp / "relay.py").write_text(RELAY)
    return tmp


@pytest.fixture(scope="module")
def hf(assets) -> dict:
    return run_distributed(_rank, 1, assets, "hf", timeout=600)[0]


@pytest.fixture(scope="module")
def vllm(assets) -> dict:
    if not vllm_engine.installed():
        pytest.skip('needs the vllm extra: pip install -e ".[vllm]"')
    return run_distributed(_rank, 1, assets, "vllm", timeout=600)[0]


def test_greedy_episodes_take_three_actions_with_observations_between(hf):
    # Every episode ran three actions, two observations of two tokens between them: holes.
    stats, greedy = hf["stats"], hf["greedy"]
    assert stats["env_turns"] == 3 * ROWS and stats["env_observation_tokens"] == 4 * ROWS
    observed = (greedy.response_attention == 1) & (greedy.action_mask == 0)
    assert observed.sum(-1).tolist() == [4] * ROWS


def test_greedy_episodes_of_hf_and_vllm_are_the_same_tokens(hf, vllm):
    hf, vllm = hf["greedy"], vllm["greedy"]
    assert torch.equal(hf.sequences, vllm.sequences)
    assert torch.equal(hf.attention_mask, vllm.attention_mask)
    assert torch.equal(hf.action_mask, vllm.action_mask)
    assert torch.equal(hf.scores, vllm.scores)


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_observations_are_attended_and_never_actions(request, name):
    batch = request.getfixturevalue(name)["sampled"]
    real = batch.response_attention.bool()
    actions = batch.action_mask.bool()
    assert bool((actions <= real).all())  # actions are real tokens
    # Each row's real response tokens are contiguous from its first column (attended).
    assert torch.equal(real, real.long().cumprod(-1).bool())
    # The engine's log-probs lie on actions only.
    assert bool((batch.logprobs[~actions] == 0).all())
    assert bool((batch.logprobs[actions] < 0).all())
    # Every episode ends with an action (its last real token).
    last = real.sum(-1) - 1
    assert bool(actions[torch.arange(len(batch)), last].all())


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_engine_log_probs_of_sampled_actions_are_the_trainers(request, name):
    # fp32 on both sides, log softmax(logits / 0.8) of the same weights by different paths (a
    # key/value cache turn by turn against one packed forward of the whole episode): about 1e-6
    # (tests/rollout/test_vllm.py); 1e-4 is the bound and catches a log-prob taken in
    # the wrong context (an observation's tokens missing or moved: differences of order 0.1).
    episodes = request.getfixturevalue(name)
    diff = episodes["diff"]
    assert diff["logprob_diff_count"] == float(episodes["sampled"].action_mask.sum())
    assert diff["logprob_diff_max"] <= 1e-4
