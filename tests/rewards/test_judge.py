"""LLM judge: score parsing, template rendering, option checks, and the `hf`-engine judge against a direct
transformers greedy generation."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.rewards import (
    REWARD_FUNCTIONS,
    MissingColumnError,
    ModelReward,
    RewardLoadError,
    ScoreError,
    parse_score,
    render_judge_prompt,
    resolve_reward,
)
from rollflow.rewards.judge import TEMPLATE_WITH_REFERENCE, TEMPLATE_WITHOUT_REFERENCE, LLMJudge, judge_value


@pytest.mark.parametrize(
    ("text", "max_score", "pattern", "expected"),
    [
        ("7", 10, None, 0.7),
        ("Score: 8.5 out of 10", 10, None, 0.85),
        ("7/10", 10, None, 0.7),  # the first number only
        ("I'd say 3, maybe 9", 10, None, 0.3),
        ("10", 10, None, 1.0),
        ("12", 10, None, 1.0),  # clipped to 1
        ("-3", 10, None, 0.0),  # clipped to 0
        ("4", 5, None, 0.8),  # 4 / 5
        ("0", 10, None, 0.0),
        ("no idea", 10, None, None),
        ("", 10, None, None),
        ("first 2 then [[9]]", 10, r"\[\[(\d+)\]\]", 0.9),  # group 1 of the regex
        ("Rating: 6", 10, r"Rating: (?P<score>\d+)", 0.6),  # the named group wins
        ("grade=B", 10, r"grade=(\w)", None),  # a match that is not a number
        ("3 apples", 10, r"\[\[(\d+)\]\]", None),  # the regex finds nothing: no fallback to the first number
    ],
)
def test_parse_score(text, max_score, pattern, expected):
    score = parse_score(text, max_score, pattern)
    assert score == (None if expected is None else pytest.approx(expected))


def test_judge_value_marks_parse_failures():
    assert judge_value("Score: 9", 10, None) == {"reward": pytest.approx(0.9), "parse_failed": 0.0}
    assert judge_value("great answer!", 10, None) == {"reward": 0.0, "parse_failed": 1.0}


def test_render_uses_row_columns_and_reference_alias():
    row = {"prompt": "2+2", "answer": "4", "topic": "math"}
    text = render_judge_prompt("[{topic}] Q={prompt} ref={reference} A={completion} {{x}}", "5", row)
    assert text == "[math] Q=2+2 ref=4 A=5 {x}"
    # An explicit `reference` column wins over `answer`.
    assert render_judge_prompt("{reference}|{completion}", "c", {"reference": "r", "answer": "a"}) == "r|c"


def test_render_default_template_depends_on_reference():
    assert render_judge_prompt(None, "c", {"prompt": "p", "answer": "a"}) == TEMPLATE_WITH_REFERENCE.format(
        prompt="p", reference="a", completion="c")
    assert render_judge_prompt(None, "c", {"prompt": "p"}) == TEMPLATE_WITHOUT_REFERENCE.format(
        prompt="p", completion="c")


def test_render_chat_prompt_and_missing_column():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render_judge_prompt("{prompt}\n{completion}", "bye", {"prompt": messages}) == \
        "user: hi\nassistant: hello\nbye"
    with pytest.raises(MissingColumnError, match=r"uses \{rubric\}, but the row has: completion, prompt"):
        render_judge_prompt("{rubric} {completion}", "c", {"prompt": "p"})


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({}, "needs model_path"),
        ({"model_path": "/does/not/exist"}, "does not exist"),
        ({"model_path": "tiny", "template": "{prompt}"}, r"must contain \{completion\}"),
        ({"model_path": "tiny", "template": "{0} {completion}"}, "not a column name"),
        ({"model_path": "tiny", "template": "{completion"}, "not a valid format string"),
        ({"model_path": "tiny", "score_regex": "(unclosed"}, "not a valid regex"),
        ({"model_path": "tiny", "max_score": 0}, "max_score must be a positive number"),
        ({"model_path": "tiny", "temperature": -1.0}, "temperature must be >= 0"),
        ({"model_path": "tiny", "max_new_tokens": 0}, "max_new_tokens must be > 0"),
        ({"model_path": "tiny", "bogus": 1}, "does not take option.*bogus.*its options: chat_template"),
    ],
)
def test_bad_llm_judge_options_fail_in_one_line(options, pattern):
    with pytest.raises(RewardLoadError, match=pattern) as info:
        resolve_reward("llm_judge", options)
    assert "\n" not in str(info.value)


def test_model_rewards_are_registered_and_bound():
    assert {"llm_judge", "http_judge", "reward_model"} <= set(REWARD_FUNCTIONS.names())
    reward = resolve_reward("llm_judge", {"model_path": "tiny", "max_score": 100})
    assert isinstance(reward, ModelReward)
    assert reward.options.model_path == "tiny" and reward.options.max_score == 100
    assert reward.options.temperature == 0.0  # greedy by default


def _reference_greedy(prompts_ids: list[list[int]], max_new_tokens: int) -> list[str]:
    """The tiny model's greedy continuation of each prompt, one prompt at a time with transformers."""
    import torch

    from rollflow.models import eos_token_ids, load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm("tiny"), load_tokenizer("tiny")
    eos = eos_token_ids(model, tokenizer)
    texts = []
    for ids in prompts_ids:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def test_llm_judge_matches_direct_generation_and_batches_the_group():
    # The bundled tiny model was trained on "a+b" -> sum. As a judge with template "{completion}+{offset}"
    # it "scores" completion + offset: a judge whose answers we can predict, and a real engine path.
    reward = resolve_reward("llm_judge", {"model_path": "tiny", "template": "{completion}+{offset}",
                                          "max_score": 200, "max_new_tokens": 4})
    judge = LLMJudge(reward.options)
    completions = ["12", "40", "7", "33", "81"]
    rows = [{"prompt": "x", "offset": str(k)} for k in (10, 20, 30, 40, 50)]
    scores = asyncio.run(judge.score_group(completions, rows))
    assert judge.engine.stats["waves"] == 1  # the group's five judge prompts were decoded together

    prompts = [judge.encode(f"{c}+{r['offset']}") for c, r in zip(completions, rows)]
    assert judge.tokenizer.decode(prompts[0]) == "<|user|>12+10<|assistant|>"  # chat template on
    expected = [judge_value(text, 200, None) for text in _reference_greedy(prompts, 4)]
    assert scores == expected
    assert sum(s["parse_failed"] for s in scores) == 0  # the tiny model answers with digits
    assert len({s["reward"] for s in scores}) > 1


def test_llm_judge_without_chat_template_and_over_long_prompts():
    reward = resolve_reward("llm_judge", {"model_path": "tiny", "template": "{completion}", "chat_template": False,
                                          "max_prompt_tokens": 5, "max_new_tokens": 2})
    judge = LLMJudge(reward.options)
    assert judge.encode("12+3") == judge.tokenizer("12+3", add_special_tokens=False)["input_ids"]
    scores = asyncio.run(judge.score_group(["12+3", "123456+1"], [{}, {}]))
    assert isinstance(scores[0], dict)
    assert scores[1] == ScoreError("judge prompt has 8 tokens, over max_prompt_tokens=5")


def test_llm_judge_missing_column_fails_only_that_sample():
    reward = resolve_reward("llm_judge", {"model_path": "tiny", "template": "{completion}+{offset}",
                                          "max_new_tokens": 2})
    judge = LLMJudge(reward.options)
    scores = asyncio.run(judge.score_group(["1", "2"], [{"offset": "1"}, {"prompt": "p"}]))
    assert isinstance(scores[0], dict)
    assert isinstance(scores[1], ScoreError) and "uses {offset}" in scores[1].message
