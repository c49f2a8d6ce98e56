"""A `tool_use` env's settings are checked at config load, before any worker starts: unknown options and
tools, bad tool options, a user tool whose module is missing, an MCP command that is not found; through the
command line, one `rollflow: error:` line and no "starting Ray"."""

from __future__ import annotations

import pytest

from rollflow.config.agentic import AgenticConfig
from rollflow.envs.make import check_env_settings
from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError
from rollflow.tools import TOOLS

INNER = {"env": "prompts", "env_kwargs": {"task": "add2", "reward": "exact_match"}}


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"tools": ["calculater"]}, UnknownNameError, r"unknown tool 'calculater'\. Did you mean 'calculator'\?"),
    ({"tools": ["no_such_tools_module:make"]}, ConfigError, r"tool 'no_such_tools_module:make': cannot import module"),
    ({"tools": [{"name": "calculator", "max_lenght": 3}]}, ConfigError, r"unknown option 'max_lenght'"),
    ({"tools": [{"name": "mcp", "command": ["no-such-mcp-server"]}]}, ConfigError,
     r"the command 'no-such-mcp-server' is not found on PATH"),
    ({"tools": []}, ConfigError, r"env 'tool_use' needs at least one tool"),
    ({"tools": ["calculator"], "max_call": 2}, ConfigError,
     r"env 'tool_use': unknown option 'max_call'\. Did you mean 'max_calls'\?"),
    ({"tools": ["calculator"], "parser": "llama"}, UnknownNameError, r"unknown tool-call parser 'llama'"),
    ({"tools": ["calculator"], "env": "frozenlak"}, UnknownNameError, r"unknown environment 'frozenlak'"),
    ({"tools": ["calculator"], "env": "tool_use", "env_kwargs": {"tools": ["nope"]}}, UnknownNameError,
     r"unknown tool 'nope'"),
])
def test_bad_settings_are_one_line_without_making_the_env(kwargs, error, message):
    with pytest.raises(error, match=message) as raised:
        check_env_settings("tool_use", {**INNER, **kwargs})
    assert "\n" not in str(raised.value)


def test_good_settings_and_other_envs_pass():
    check_env_settings("tool_use", {**INNER, "tools": ["calculator", {"name": "python", "timeout_s": 2}],
                                    "max_calls": 2, "parser": "hermes"})
    check_env_settings("frozenlake", {"anything": 1})  # other envs check their kwargs when made


@pytest.mark.parametrize("setting", ["kwargs", "eval_kwargs"])
def test_the_config_refuses_them_at_load_naming_the_setting(setting):
    env = {"id": "tool_use", "kwargs": {**INNER, "tools": ["calculator"]}}
    env[setting] = {**INNER, "tools": ["calculater"]}
    with pytest.raises(ValueError, match=rf"env\.{setting}: unknown tool 'calculater'"):
        AgenticConfig.model_validate({"env": env})


def test_the_command_line_says_it_in_one_line_before_starting_ray(tmp_path, cli):
    config = tmp_path / "tools.yaml"
    config.write_text("pipeline: agentic\nenv:\n  id: tool_use\n  kwargs:\n    tools: [calculator]\n"
                      "    env: prompts\n    env_kwargs: {task: add2, reward: exact_match}\n")
    done = cli("train", config, "env.kwargs.tools=[calculater]", f"output.dir={tmp_path}/runs")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "rollflow: error: env.kwargs: unknown tool 'calculater'. Did you mean 'calculator'? Valid: "
        f"{', '.join(TOOLS.names())}; or a tool of your own as 'module:factory'"]
    assert "starting Ray" not in done.stdout + done.stderr  # said even where Ray is up: the checks came first
