"""The tool-use env (`tool_use`) and the prompt env (`prompts`): tool calls run and answered as tool turns,
malformed calls a penalized turn with the error as the observation, the answer scored by the inner env."""

import json

import pytest

from rollflow.envs.base import ENVS
from rollflow.envs.make import make_env
from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError

ROWS = [{"prompt": "347*29", "answer": "10063"}, {"prompt": "12*3", "answer": "36"}]


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def rows_path(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


@pytest.fixture
def env(rows_path):
    return make_env("tool_use", tools=["calculator"], env_kwargs={"path": rows_path, "reward": "exact_match"},
                    max_calls=2, max_output_chars=8)


def test_a_tool_call_is_answered_with_its_result_then_the_answer_is_scored(env):
    observation, info = env.reset(seed=0)
    assert observation == "347*29"
    observation, reward, terminated, truncated, info = env.step(_call("calculator", expression="347*29"))
    assert (observation, reward, terminated, truncated) == ("10063", 0.0, False, False)
    assert info["tool_results"] == ["10063"] and info["tool_calls"] == 1 and info["tool_errors"] == 0
    assert info["invalid_action"] is False and info["tool_seconds"] >= 0
    observation, reward, terminated, truncated, info = env.step("10063")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert "tool_results" not in info and info["tool_calls"] == 0


def test_the_seed_picks_the_row_and_a_wrong_answer_scores_zero(env):
    assert env.reset(seed=3)[0] == "12*3"  # 3 % 2 rows
    _, reward, terminated, _, info = env.step("37")
    assert (reward, terminated, info["success"]) == (0.0, True, False)


@pytest.mark.parametrize("action, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 1+}}</tool_call>', "error: tool call 1 is not valid JSON"),
    (_call("search", query="x"), "error: unknown tool 'search'; the tools: calculator"),
    (_call("calculator"), "error: "),  # the required expression is missing
    (_call("calculator", expression="1", extra=2), "error: "),
])
def test_a_malformed_call_is_a_penalized_turn_whose_observation_is_the_error(env, action, error):
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(action)
    assert observation.startswith(error) and info["tool_results"] == [observation]
    assert (reward, terminated, truncated, info["invalid_action"]) == (-0.1, False, False, True)
    assert info["tool_errors"] == info["tool_calls"] == 1  # an unreadable call is a (failed) call too
    assert env.step("10063")[1] == 1.0  # the episode goes on


def test_a_failing_tool_is_an_error_result_not_a_malformed_call(env):
    env.reset(seed=0)
    observation, reward, _, _, info = env.step(_call("calculator", expression="1/0"))
    assert observation == "error: division by zero"
    assert (reward, info["invalid_action"], info["tool_errors"]) == (0.0, False, 1)


def test_calls_past_the_episode_budget_are_refused_and_long_outputs_cut(env):
    env.reset(seed=0)
    observation, *_ = env.step(_call("calculator", expression="2**40"))
    assert observation == "10995116 ... (cut at 8 characters)"
    observation, _, _, _, info = env.step(_call("calculator", expression="1+1") + _call("calculator", expression="2"))
    assert info["tool_results"] == ["2", "error: no tool calls left (2 per episode); answer now"]
    assert info["invalid_action"] is True and info["tool_calls"] == 2
    env.reset(seed=0)  # a new episode has its budget back
    assert env.step(_call("calculator", expression="1+1"))[0] == "2"


def test_tools_are_json_schema_function_specs(env):
    [spec] = env.tools()
    assert spec["type"] == "function" and spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]


def test_it_wraps_any_text_env():
    env = make_env("tool_use", tools=["calculator"], env="guess_number", env_kwargs={"high": 10})
    observation, _ = env.reset(seed=1)
    assert env.step(_call("calculator", expression="5+5"))[0] == "10"
    observation, _, _, _, info = env.step("5")  # no call: the guess goes to the game
    assert "tool_results" not in info and observation != "10"


def test_bad_settings_fail_at_make_with_one_line(rows_path):
    kwargs = {"env_kwargs": {"path": rows_path}}
    with pytest.raises(ConfigError, match="needs at least one tool"):
        make_env("tool_use", tools=[], **kwargs)
    with pytest.raises(UnknownNameError, match="tool-call parser"):
        make_env("tool_use", tools=["calculator"], parser="llama", **kwargs)
    with pytest.raises(ConfigError, match="exactly one of path"):
        make_env("prompts")
    with pytest.raises(ConfigError, match="needs a reward worker"):
        make_env("prompts", path=rows_path, reward="llm_judge", reward_kwargs={"model_path": "tiny"})


def test_the_prompt_env_alone_is_one_turn_rlvr(rows_path):
    env = ENVS.get("prompts")(path=rows_path, reward="exact_match")
    assert env.reset(seed=1) == ("12*3", {"success": False, "anchor": "12*3"})
    _, reward, terminated, truncated, info = env.step(" 36 ")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_an_mcp_server_s_tools_are_called_through_the_env(rows_path):
    pytest.importorskip("mcp")
    import sys
    from pathlib import Path

    server = str(Path(__file__).parents[1] / "tools" / "mcp_echo_server.py")
    env = make_env("tool_use", tools=[{"name": "mcp", "command": [sys.executable, server], "tools": ["add", "fail"]}],
                   env_kwargs={"path": rows_path, "reward": "exact_match"})
    assert sorted(spec["function"]["name"] for spec in env.tools()) == ["add", "fail"]
    env.reset(seed=0)
    observation, _, _, _, info = env.step(_call("add", a=2, b=3) + _call("fail"))
    assert info["tool_results"] == ["5", "error: Error executing tool fail: this tool always fails"]
    assert info["tool_errors"] == 1 and info["invalid_action"] is False
    assert env.step(_call("add", a="two", b=3))[4]["invalid_action"] is True  # the schema says integer
