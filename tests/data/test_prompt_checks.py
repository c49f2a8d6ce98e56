"""The driver's checks of every prompt and row before a run starts (`rollflow.inputs.prompt_sets`)."""

from types import SimpleNamespace

import pytest

from rollflow.config import load_config
from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.prompts import PromptEncoder
from rollflow.errors import ConfigError, DataError
from rollflow.inputs.prompt_sets import (
    check_generation_limits,
    check_reward_columns,
    context_length,
    dataset_source,
    encode_prompts,
    engine_context_key,
    load_prompt_sets,
    resource_warnings,
    run_context_length,
)
from rollflow.pipelines.rlvr import rlvr_roles
from rollflow.rewards.registry import needs_columns, required_columns

SOURCE = "data.train (rows.jsonl)"


@pytest.fixture(scope="module")
def encoder():
    return PromptEncoder(build_ascii_tokenizer(), max_prompt_tokens=40)


def _encode_error(encoder, rows, **limits) -> str:
    with pytest.raises(DataError) as info:
        encode_prompts(encoder, rows, SOURCE, **limits)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_every_row_is_encoded_up_front(encoder):
    rows = [{"prompt": "12+3"}, {"prompt": "4+5", "answer": "9"}]
    encoded = encode_prompts(encoder, rows, SOURCE, max_new_tokens=8, context_length=64)
    assert [p.text for p in encoded] == ["<|user|>12+3<|assistant|>", "<|user|>4+5<|assistant|>"]
    assert encoded[1].row is rows[1]


@pytest.mark.parametrize("prompt, message", [
    (None, "the prompt (column 'prompt') is null"),
    ("", "the prompt (column 'prompt') is empty"),
    ("  \n", "the prompt (column 'prompt') is empty"),
    (12, "the prompt (column 'prompt') must be a string, not int: 12"),
    ({"text": "1+1"}, "the prompt (column 'prompt') must be a string, not dict: {'text': '1+1'}"),
    ([{"role": "user"}], "the prompt (column 'prompt') is a list, but not of chat messages"),
    ([{"role": "user", "content": " "}], "the prompt (column 'prompt') has no message with content"),
])
def test_a_bad_prompt_names_its_row(encoder, prompt, message):
    rows = [{"prompt": "1+1"}, {"prompt": "2+2"}, {"prompt": prompt}]
    assert _encode_error(encoder, rows).startswith(f"{SOURCE} row 3: {message}")


def test_chat_messages_are_a_prompt_when_a_template_renders_them(encoder):
    messages = [{"role": "user", "content": "1+1"}]
    assert encode_prompts(encoder, [{"prompt": messages}], SOURCE)[0].text == "<|user|>1+1<|assistant|>"
    raw = PromptEncoder(build_ascii_tokenizer(), apply_chat_template=False)
    assert "no chat template renders it" in _encode_error(raw, [{"prompt": messages}])


def test_a_template_that_refuses_a_message_is_a_data_error(encoder):
    message = _encode_error(encoder, [{"prompt": [{"role": "function", "content": "be brief"}]}])
    assert message.startswith(f"{SOURCE} row 1: the chat template cannot render the prompt")


@pytest.mark.parametrize("prompt, lost", [
    ("é+ü=", "'é', 'ü'"),
    ("2+2 🙂", "'🙂'"),
    ("1+1=ﬁ?", "'ﬁ'"),
])
def test_characters_the_tokenizer_drops_are_named(prompt, lost):
    message = _encode_error(PromptEncoder(_dropping_tokenizer(), max_prompt_tokens=40), [{"prompt": prompt}])
    assert message.startswith(f"{SOURCE} row 1: the tokenizer cannot represent {lost} ")


def _dropping_tokenizer():
    """The ASCII tokenizer without its byte fallback tokens: a byte-level BPE with no unknown token (what
    `Qwen2Tokenizer` builds) then drops every non-ASCII character without a trace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollflow.data.char_tokenizer import ASCII_CHAT_TEMPLATE, ASCII_SPECIAL_TOKENS, ascii_vocabulary

    vocabulary = {token: index for token, index in ascii_vocabulary().items() if index < 103}
    backend = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(ASCII_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   chat_template=ASCII_CHAT_TEMPLATE)


def test_non_ascii_characters_round_trip_through_the_ascii_tokenizers_bytes(encoder):
    assert encode_prompts(encoder, [{"prompt": "What is 1 + 1 ? é 🙂"}], SOURCE)


def test_the_unknown_token_is_an_error():
    tokenizer = build_ascii_tokenizer()
    encoder = PromptEncoder(tokenizer)
    message = _encode_error(encoder, [{"prompt": "1+<unk>"}])
    assert "encodes to the tokenizer's unknown token '<unk>'" in message


def test_prompt_and_response_must_fit_the_context(encoder):
    rows = [{"prompt": "1" * 20}]  # 22 tokens with the chat markers
    assert encode_prompts(encoder, rows, SOURCE, max_new_tokens=10, context_length=32)
    message = _encode_error(encoder, rows, max_new_tokens=11, context_length=32)
    assert message == (f"{SOURCE} row 1: the prompt has 22 tokens, and with rollout.max_new_tokens = 11 that is "
                       "33, over the model's context of 32 tokens; keep prompts within 21 tokens or lower "
                       "rollout.max_new_tokens")


def test_max_prompt_tokens_names_the_row(encoder):
    message = _encode_error(encoder, [{"prompt": "1+1"}, {"prompt": "1" * 50}])
    assert message.startswith(f"{SOURCE} row 2: a prompt has 52 tokens, over data.max_prompt_tokens=40")


def test_generation_limits_leave_room_for_a_prompt():
    model = SimpleNamespace(max_position_embeddings=64)

    def check(*overrides):
        config = load_config(None, list(overrides))
        check_generation_limits(config, run_context_length(config, model))

    check("rollout.max_new_tokens=63")
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens is 64, but the model's context holds 64 tokens"):
        check("rollout.max_new_tokens=64")
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens is 100, .* set it below 64"):
        check("eval.max_new_tokens=100")
    config = load_config(None, ["eval.max_new_tokens=100"])
    check_generation_limits(config, run_context_length(config, SimpleNamespace()))  # no context
    # a simulated cluster runs no model: its tokens stand for cluster.sim.token_scale each
    check("rollout.max_new_tokens=512", "cluster.device=sim", "cluster.num_devices=2", "roles.actor_infer.engine=sim",
          "roles.actor_train.backend=sim")


def test_an_engine_context_shorter_than_the_models_is_the_runs_context(encoder):
    """vLLM's `max_model_len` (SGLang's `context_length`) below prompt + response would cut every response
    short, silently: the checks measure against it and name it."""
    model = SimpleNamespace(max_position_embeddings=64)

    def config(*overrides):
        return load_config(None, ["roles.actor_infer.engine=vllm", *overrides])

    assert run_context_length(config("roles.actor_infer.engine_kwargs={max_model_len: 16}"), model) == 16
    assert run_context_length(config("roles.actor_infer.engine_kwargs={max_model_len: 128}"), model) == 64
    assert run_context_length(config("roles.actor_infer.engine=sglang",
                                     "roles.actor_infer.engine_kwargs={context_length: 16}"), model) == 16
    assert run_context_length(config("roles.actor_infer.engine=hf"), model) == 64  # no engine limit
    assert run_context_length(config("roles.actor_infer.engine_kwargs={max_model_len: 16}"), SimpleNamespace()) == 16

    short = config("roles.actor_infer.engine_kwargs={max_model_len: 16}", "rollout.max_new_tokens=16")
    with pytest.raises(ConfigError) as caught:
        check_generation_limits(short, run_context_length(short, model))
    assert str(caught.value) == ("rollout.max_new_tokens is 16, but the engine's context holds 16 tokens "
                                 "(roles.actor_infer.engine_kwargs.max_model_len), prompt included; set it below 16 "
                                 "or raise roles.actor_infer.engine_kwargs.max_model_len")
    assert engine_context_key(short, 64) is None  # a context the engine does not set is the model's

    rows = [{"prompt": "1" * 5}]  # 7 tokens with the chat markers: 7 + 10 > 16
    message = _encode_error(encoder, rows, max_new_tokens=10, context_length=16,
                            engine_context_key="roles.actor_infer.engine_kwargs.max_model_len")
    assert message == (f"{SOURCE} row 1: the prompt has 7 tokens, and with rollout.max_new_tokens = 10 that is 17, "
                       "over the engine's context of 16 tokens (roles.actor_infer.engine_kwargs.max_model_len); keep "
                       "prompts within 6 tokens, lower rollout.max_new_tokens or raise "
                       "roles.actor_infer.engine_kwargs.max_model_len")


def test_the_vllm_quickstart_with_a_short_max_model_len_stops_before_the_run():
    config = load_config("examples/quickstart_vllm.yaml", ["roles.actor_infer.engine_kwargs={max_model_len: 8}",
                                                           "data.train.limit=4", "data.eval.limit=4"])
    with pytest.raises(DataError) as caught:
        load_prompt_sets(config, rlvr_roles(config))
    assert str(caught.value) == (
        "data.train (task 'add2') row 1: the prompt has 7 tokens, and with rollout.max_new_tokens = 6 that is 13, "
        "over the engine's context of 8 tokens (roles.actor_infer.engine_kwargs.max_model_len); keep prompts within "
        "2 tokens, lower rollout.max_new_tokens or raise roles.actor_infer.engine_kwargs.max_model_len")


def test_context_length_reads_each_familys_attribute():
    assert context_length(SimpleNamespace(max_position_embeddings=64)) == 64
    assert context_length(SimpleNamespace(n_positions=1024)) == 1024  # GPT-2
    assert context_length(SimpleNamespace(max_position_embeddings=None)) is None


def test_dataset_source_names_the_key_and_the_file_or_task():
    data = load_config(None, ["data.eval={path: /data/e.jsonl}"]).data
    assert dataset_source("data.train", data.train) == "data.train (task 'add2')"
    assert dataset_source("data.eval", data.eval) == "data.eval (/data/e.jsonl)"


@needs_columns("answer", "level")
def _graded(completion: str, **row) -> float:
    return 0.0


def test_declared_reward_columns_are_checked_in_every_row():
    assert required_columns(_graded) == ("answer", "level")
    columns = {"graded": required_columns(_graded)}
    check_reward_columns([{"prompt": "x", "answer": "1", "level": 2}], SOURCE, columns)
    with pytest.raises(DataError) as info:
        check_reward_columns([{"prompt": "x", "answer": "1", "level": 2}, {"prompt": "y", "answer": "2"}],
                             SOURCE, columns)
    assert str(info.value) == (f"{SOURCE} row 2: reward 'graded' needs the column 'level', which the row lacks "
                               "(its columns: answer, prompt)")
    with pytest.raises(DataError, match=r"row 1: .* 'answer', .*\(its columns: answer, level, prompt\) "
                                        r"\(data.answer_key is 'solution'\)$"):
        check_reward_columns([{"prompt": "x", "answer": None, "level": 1}], SOURCE, columns, "solution")


def test_math_answer_declares_the_answer_column():
    from rollflow.rewards.registry import REWARD_FUNCTIONS

    if not required_columns(REWARD_FUNCTIONS["math_answer"]):
        pytest.skip("rollflow/rewards/math.py: math_answer lacks @needs_columns('answer')")
    assert required_columns(REWARD_FUNCTIONS["math_answer"]) == ("answer",)


def test_resource_warnings_name_the_busiest_role(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    roles = ["actor_train", "actor_infer"]
    quickstart = load_config("examples/quickstart.yaml")
    assert resource_warnings(quickstart, roles) == []  # 2 + 1 threads, but the roles take turns
    config = load_config(None, ["roles.actor_train.num_cpus=64", "cluster.num_cpus=8"])
    warnings = resource_warnings(config, roles)
    assert len(warnings) == 2
    assert warnings[0].startswith("cluster.num_cpus is 8 but this machine has 2 CPU cores")
    assert warnings[1].startswith("roles.actor_train runs 64 threads (1 worker(s) x num_cpus 64) on a machine "
                                  "with 2 CPU cores")
    many = load_config(None, ["roles.actor_infer.num_workers=4", "roles.actor_infer.num_cpus=1"])
    assert "roles.actor_infer runs 4 threads" in resource_warnings(many, roles)[0]
    assert resource_warnings(load_config(None, [*["roles.actor_train.num_cpus=64"], "cluster.address=auto"]),
                             roles) == []  # a cluster's nodes are other machines
