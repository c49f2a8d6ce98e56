"""`reward_model`: a tiny random Qwen2ForSequenceClassification saved locally; the scorer's batched, padded
scores equal a direct transformers forward of each sample on its own."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rollflow.rewards import RewardLoadError, ScoreError, resolve_reward
from rollflow.rewards.reward_model import RewardModelScorer, reward_model_text
from tests.conftest import save_random_model


def save_reward_model(path, num_labels: int = 1, seed: int = 0) -> str:
    """A random 1-layer Qwen2 sequence classifier with the char tokenizer, saved under `path`."""
    return save_random_model(path, seed=seed, hidden=32, layers=1, num_labels=num_labels)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    return save_reward_model(tmp_path_factory.mktemp("reward_model"))


def _direct_scores(model_dir: str, texts: list[str]) -> list[float]:
    """Each text alone through the model: no padding, no batching."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0])
                for t in texts]


def test_scores_equal_a_direct_forward(reward_model_dir):
    scorer = RewardModelScorer(resolve_reward("reward_model", {"model_path": reward_model_dir,
                                                               "batch_size": 2}).options)
    completions = ["4", "22", "1000", "x", "9*9=81"]  # different lengths: padded batches of 2, 2 and 1
    rows = [{"prompt": "2+2"}, {"prompt": "11+11"}, {"prompt": "10*100"}, {"prompt": "?"}, {"prompt": "9*9"}]
    scores = asyncio.run(scorer.score_group(completions, rows))
    # The chat template renders a user turn then the assistant turn ending in <eos>.
    texts = [f"<|user|>{r['prompt']}<|assistant|>{c}<eos>" for c, r in zip(completions, rows)]
    expected = _direct_scores(reward_model_dir, texts)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 4) for s in scores}) == len(scores)  # a random model still tells them apart


def test_sigmoid_and_no_chat_template(reward_model_dir):
    options = {"model_path": reward_model_dir, "normalize": "sigmoid", "chat_template": False}
    scorer = RewardModelScorer(resolve_reward("reward_model", options).options)
    scores = asyncio.run(scorer.score_group(["4", "5"], [{"prompt": "2+2="}] * 2))
    raw = _direct_scores(reward_model_dir, ["2+2=4", "2+2=5"])  # prompt + completion, nothing else
    assert scores == pytest.approx([1 / (1 + math.exp(-r)) for r in raw], abs=1e-6)


def test_chat_messages_prompt_and_custom_prompt_key(reward_model_dir):
    from rollflow.models import load_tokenizer

    tokenizer = load_tokenizer(reward_model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "1+1"}]
    assert reward_model_text(tokenizer, messages, "2", True) == \
        "<|user|>hi<|assistant|>yo<eos><|user|>1+1<|assistant|>2<eos>"
    scorer = RewardModelScorer(resolve_reward("reward_model", {"model_path": reward_model_dir,
                                                               "prompt_key": "question"}).options)
    scores = asyncio.run(scorer.score_group(["2", "2"], [{"question": "1+1"}, {"prompt": "1+1"}]))
    assert scores[0] == pytest.approx(_direct_scores(reward_model_dir, ["<|user|>1+1<|assistant|>2<eos>"])[0],
                                      abs=1e-5)
    assert isinstance(scores[1], ScoreError) and "needs the dataset column 'question'" in scores[1].message


def test_over_long_input_fails_its_sample_only(reward_model_dir):
    scorer = RewardModelScorer(resolve_reward("reward_model", {"model_path": reward_model_dir}).options)
    assert scorer.max_tokens == 64  # the model's max_position_embeddings
    scores = asyncio.run(scorer.score_group(["1", "9" * 80], [{"prompt": "p"}] * 2))
    assert isinstance(scores[0], float)
    # <|user|>, "p", <|assistant|>, 80 digits, <eos>: special tokens are one token each: 1 + 1 + 1 + 80 + 1
    assert scores[1] == ScoreError("reward-model input has 84 tokens (limit 64)")


def test_bad_options_and_models(tmp_path, reward_model_dir):
    with pytest.raises(RewardLoadError, match="needs model_path"):
        resolve_reward("reward_model")
    with pytest.raises(RewardLoadError, match="unknown reward-model normalization 'softmax'.*sigmoid"):
        resolve_reward("reward_model", {"model_path": reward_model_dir, "normalize": "softmax"})
    two_labels = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelScorer(resolve_reward("reward_model", {"model_path": two_labels}).options)
