"""LLM-as-a-judge rewards: a judge model reads each completion and answers with a score.

Two registered model rewards share the prompt template and the score parser:

* `llm_judge`: the judge is served by rollflow's own `hf` engine inside a reward worker; a group's judge
  prompts go to the engine together and are decoded in one batch.
* `http_judge`: the judge is any OpenAI-compatible server (`POST {base_url}/v1/chat/completions`: vLLM,
  SGLang, TGI, a hosted API), called with the standard library, at most `max_concurrency` requests at a time
  per worker, each with a timeout and retries with exponential backoff.

Both return `{"reward": score, "parse_failed": 0 or 1}` per sample (`http_judge` adds `call_failed`): the
judge's first number (or the `score_regex` match) divided by `max_score` and clipped to [0, 1]; an answer
with no number scores 0 with `parse_failed = 1`, which is logged as its own metric.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import string
import time
from dataclasses import dataclass, field
from typing import Any

from rollflow.rewards.registry import REWARD_FUNCTIONS, MissingColumnError, ModelReward, Row, ScoreError

TEMPLATE_WITH_REFERENCE = (
    "Grade the answer to the question against the reference answer.\n"
    "Question: {prompt}\nReference answer: {reference}\nAnswer: {completion}\n"
    "Reply with a score from 0 (wrong) to 10 (fully correct), the number only."
)
TEMPLATE_WITHOUT_REFERENCE = (
    "Grade the answer to the question.\n"
    "Question: {prompt}\nAnswer: {completion}\n"
    "Reply with a score from 0 (useless) to 10 (excellent), the number only."
)
_FIRST_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


# ---- prompt template and score parser (pure) -----------------------------------------------------------
def template_fields(template: str) -> list[str]:
    """The `{name}` fields of a judge template; raises ValueError for positional or indexed fields.

    Literal braces are written `{{` and `}}`, as in `str.format`.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"template is not a valid format string ({error}); write literal braces as {{{{ }}}}") \
            from None
    names = [name for _, name, _, _ in parsed if name is not None]
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise ValueError(f"template field {{{bad[0]}}} is not a column name; fields are {{column}} from the row "
                         "or {completion}; write literal braces as {{ }}")
    return names


def _as_text(value: Any) -> str:
    """A row value as judge-prompt text: chat messages as `role: content` lines, anything else str()."""
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)
    return str(value)


def render_judge_prompt(template: str | None, completion: str, row: Row, reward: str = "llm_judge") -> str:
    """Fill a judge template from the sample.

    Args:
        template: a `str.format` template over the row's columns plus `{completion}` and `{reference}`
            (the row's `reference` column, else its `answer`). None: `TEMPLATE_WITH_REFERENCE` when the
            row has a reference, else `TEMPLATE_WITHOUT_REFERENCE`.
        completion: the policy's completion.
        row: the dataset row.
        reward: the reward's name, for the error message.

    Returns:
        The judge prompt text.

    Raises:
        MissingColumnError: the template names a column the row does not have.
    """
    context = {key: _as_text(value) for key, value in row.items() if value is not None}
    if "reference" not in context and "answer" in context:
        context["reference"] = context["answer"]
    context["completion"] = completion
    if template is None:
        template = TEMPLATE_WITH_REFERENCE if "reference" in context else TEMPLATE_WITHOUT_REFERENCE
    missing = [name for name in template_fields(template) if name not in context]
    if missing:
        present = ", ".join(sorted(context)) or "none"
        raise MissingColumnError(f"reward {reward!r}: the judge template uses {{{missing[0]}}}, but the row has: "
                                 f"{present}")
    return template.format_map(context)


def parse_score(text: str, max_score: float = 10.0, pattern: re.Pattern | str | None = None) -> float | None:
    """The judge's score in [0, 1], or None when its answer holds no score.

    Args:
        text: the judge's answer.
        max_score: the top of the judge's scale; the raw score is divided by it, then clipped to [0, 1].
        pattern: where the score is: a regex whose group `score` (or group 1, or the whole match) is the
            number. None: the first number in the text (`-?12`, `8.5`; `"7/10"` reads 7).

    Returns:
        `clip(raw / max_score, 0, 1)`, or None when nothing matches or the match is not a number.
    """
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern or _FIRST_NUMBER
    match = regex.search(text)
    if match is None:
        return None
    if "score" in regex.groupindex:
        raw = match.group("score")
    else:
        raw = match.group(1) if regex.groups else match.group(0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    return min(max(value / max_score, 0.0), 1.0)


def judge_value(text: str, max_score: float, pattern: re.Pattern | str | None) -> dict[str, float]:
    """`{"reward": score, "parse_failed": 0.0}`, or `{"reward": 0.0, "parse_failed": 1.0}` when unparseable."""
    score = parse_score(text, max_score, pattern)
    return {"reward": 0.0 if score is None else score, "parse_failed": float(score is None)}


# ---- options -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class JudgeScoring:
    """Options both judges share: the prompt template and the score parser (see `parse_score`)."""

    template: str | None = None
    max_score: float = 10.0
    score_regex: str | None = None

    def __post_init__(self) -> None:
        if self.template is not None:
            if not isinstance(self.template, str) or not self.template.strip():
                raise ValueError("template must be a non-empty string")
            if "completion" not in template_fields(self.template):
                raise ValueError("template must contain {completion}, or the judge never sees the answer")
        if not (isinstance(self.max_score, (int, float)) and self.max_score > 0):
            raise ValueError(f"max_score must be a positive number, got {self.max_score!r}")
        if self.score_regex is not None:
            try:
                re.compile(self.score_regex)
            except re.error as error:
                raise ValueError(f"score_regex {self.score_regex!r} is not a valid regex ({error})") from None


@dataclass(frozen=True, kw_only=True)
class LLMJudgeOptions(JudgeScoring):
    """Options of `llm_judge` (the `kwargs` of its entry in `reward.functions`).

    Attributes:
        model_path: the judge model: bundled name, local HF directory or hub id (required).
        chat_template: wrap the prompt as a user turn with the judge tokenizer's chat template (if it has one).
        max_new_tokens: tokens the judge may write.
        temperature: 0 = greedy (the default: a judge should not be a dice roll).
        max_prompt_tokens: longer judge prompts fail their sample; None = the judge's context length
            (`max_position_embeddings`) minus `max_new_tokens`.
        dtype, max_batch_size, seed, trust_remote_code: passed to the `hf` engine.
    """

    model_path: str | None = None
    chat_template: bool = True
    max_new_tokens: int = 8
    temperature: float = 0.0
    max_prompt_tokens: int | None = None
    dtype: str = "float32"
    max_batch_size: int = 256
    seed: int = 0
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_path:
            raise ValueError("needs model_path: the judge model (bundled name, local directory or hub id)")
        from rollflow.errors import ModelLoadError
        from rollflow.models import resolve_model_path

        try:
            resolve_model_path(self.model_path)
        except ModelLoadError as error:
            raise ValueError(str(error)) from None
        _check_positive(max_new_tokens=self.max_new_tokens, max_batch_size=self.max_batch_size,
                        max_prompt_tokens=self.max_prompt_tokens)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


@dataclass(frozen=True, kw_only=True)
class HTTPJudgeOptions(JudgeScoring):
    """Options of `http_judge`.

    Attributes:
        base_url: the server, e.g. `http://127.0.0.1:8000` or `https://api.example.com/v1` (required).
        model: the model name the server expects (required).
        api_key_env: name of the environment variable holding the API key (sent as a Bearer token).
        system_prompt: an optional system message before the judge prompt.
        max_tokens, temperature: sampling of the judge; `extra_body` adds any other request fields.
        timeout_s: per socket operation (connect, each read) of one attempt.
        max_retries: retries after a timeout, a connection error, HTTP 429 or 5xx (4xx are not retried).
        backoff_s: wait before retry k (0-based) is `backoff_s * 2**k`.
        max_concurrency: requests in flight at once, per reward worker.
        on_error: what a sample gets when every attempt failed: "fail" (the sample is marked failed and
            not trained on) or "zero" (reward 0 with `call_failed = 1`).
    """

    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    system_prompt: str | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 1.0
    max_concurrency: int = 8
    on_error: str = "fail"
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("needs model: the model name the server serves")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env names {self.api_key_env!r}, but that environment variable is not set")
        if self.on_error not in ("fail", "zero"):
            raise ValueError(f"on_error must be 'fail' or 'zero', got {self.on_error!r}")
        _check_positive(max_tokens=self.max_tokens, timeout_s=self.timeout_s,
                        max_concurrency=self.max_concurrency)
        if self.max_retries < 0 or self.backoff_s < 0:
            raise ValueError("max_retries and backoff_s must be >= 0")

    @property
    def url(self) -> str:
        """The chat-completions endpoint: `/chat/completions` after a base ending in `/v1`, else
        `/v1/chat/completions`."""
        base = self.base_url.rstrip("/")
        return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def _check_positive(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


# ---- scorers (built in a reward worker) ----------------------------------------------------------------
class LLMJudge:
    """`llm_judge`'s scorer: the judge model in an `hf` engine.

    Args:
        options: the bound `LLMJudgeOptions`.
        device: torch device of the engine ("cpu", "cuda").
    """

    def __init__(self, options: LLMJudgeOptions, device: str = "cpu"):
        from rollflow.engines import create_engine
        from rollflow.models import load_tokenizer

        self.options = options
        self.engine = create_engine("hf", model_path=options.model_path, dtype=options.dtype,
                                    max_batch_size=options.max_batch_size, seed=options.seed, device=device,
                                    trust_remote_code=options.trust_remote_code)
        self.tokenizer = load_tokenizer(options.model_path, options.trust_remote_code)
        self.use_chat_template = options.chat_template and getattr(self.tokenizer, "chat_template", None)
        context = getattr(self.engine.model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = options.max_prompt_tokens or (
            context - options.max_new_tokens if context else None)
        self.pattern = re.compile(options.score_regex) if options.score_regex else None
        self._ids = itertools.count()

    def encode(self, prompt: str) -> list[int]:
        """Judge prompt text -> token ids (chat-wrapped when `chat_template` and the tokenizer has one)."""
        if self.use_chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    async def judge(self, prompts: list[str]) -> list[str | ScoreError]:
        """The judge's answer to each prompt; all prompts are submitted together and decoded in one wave."""
        import asyncio

        from rollflow.engines.base import GenerationRequest, SamplingParams

        params = SamplingParams(self.options.max_new_tokens, self.options.temperature, n=1)
        encoded = [self.encode(prompt) for prompt in prompts]
        requests = {}
        for index, ids in enumerate(encoded):
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                continue
            requests[index] = self.engine.generate(GenerationRequest(f"judge-{next(self._ids)}", ids, params))
        completions = dict(zip(requests, await asyncio.gather(*requests.values())))
        answers: list[str | ScoreError] = []
        for index, ids in enumerate(encoded):
            if index not in completions:
                answers.append(ScoreError(f"judge prompt has {len(ids)} tokens, over max_prompt_tokens="
                                          f"{self.max_prompt_tokens}"))
                continue
            tokens = completions[index].outputs[0].token_ids
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return answers

    def offload(self) -> None:
        """Free the judge's device memory while a colocated role runs (the engine sleeps)."""
        self.engine.sleep()

    def onload(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()

    async def score_group(self, completions: list[str], rows: list[Row]) -> list[dict[str, float] | ScoreError]:
        """One `{"reward", "parse_failed"}` dict (or `ScoreError`) per completion."""
        prompts: dict[int, str] = {}
        results: list[Any] = [None] * len(completions)
        for index, (completion, row) in enumerate(zip(completions, rows)):
            try:
                prompts[index] = render_judge_prompt(self.options.template, completion, row, "llm_judge")
            except MissingColumnError as error:
                results[index] = ScoreError(str(error))
        for index, answer in zip(prompts, await self.judge(list(prompts.values()))):
            results[index] = answer if isinstance(answer, ScoreError) else judge_value(
                answer, self.options.max_score, self.pattern)
        return results


class JudgeCallError(RuntimeError):
    """An OpenAI-compatible judge call that failed for good (after retries, or a non-retryable status)."""


class _Retryable(Exception):
    """A failure worth another attempt: timeout, connection error, HTTP 429 / 5xx."""


class HTTPJudge:
    """`http_judge`'s scorer: an OpenAI-compatible chat-completions endpoint.

    Args:
        options: the bound `HTTPJudgeOptions`.
        device: unused (the model lives behind the endpoint).
    """

    def __init__(self, options: HTTPJudgeOptions, device: str = "cpu"):
        from concurrent.futures import ThreadPoolExecutor

        self.options = options
        self.url = options.url
        self.api_key = None
        if options.api_key_env is not None:
            self.api_key = os.environ.get(options.api_key_env)
            if not self.api_key:
                raise ValueError(f"http_judge: environment variable {options.api_key_env!r} is not set in "
                                 "the reward worker")
        self.pattern = re.compile(options.score_regex) if options.score_regex else None
        # One pool per worker: it bounds the requests in flight across every group this worker scores.
        self.pool = ThreadPoolExecutor(max_workers=options.max_concurrency, thread_name_prefix="http-judge")

    def request_body(self, prompt: str) -> dict[str, Any]:
        """The JSON body of one chat-completions request."""
        messages = [{"role": "user", "content": prompt}]
        if self.options.system_prompt:
            messages.insert(0, {"role": "system", "content": self.options.system_prompt})
        return {"model": self.options.model, "messages": messages, "max_tokens": self.options.max_tokens,
                "temperature": self.options.temperature, **self.options.extra_body}

    def complete(self, prompt: str) -> str:
        """The judge's answer to `prompt`, retrying as the options say; raises `JudgeCallError`."""
        body = json.dumps(self.request_body(prompt)).encode()
        attempts = self.options.max_retries + 1
        for attempt in range(attempts):
            try:
                return self._post(body)
            except _Retryable as error:
                if attempt + 1 == attempts:
                    raise JudgeCallError(f"{self.url} failed {attempts} time(s); last: {error}") from None
                time.sleep(self.options.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _post(self, body: bytes) -> str:
        # Imported here: `rollflow.rewards` is also imported by light helper processes that never call out.
        import urllib.error
        import urllib.request
        from http.client import HTTPException

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = _first_line(error.read().decode(errors="replace")) or error.reason
            if error.code == 429 or error.code >= 500:
                raise _Retryable(f"HTTP {error.code}: {detail}") from None
            raise JudgeCallError(f"{self.url} answered HTTP {error.code}: {detail}") from None
        except (TimeoutError, urllib.error.URLError, ConnectionError, HTTPException) as error:
            reason = getattr(error, "reason", None) or error
            raise _Retryable(f"{type(error).__name__}: {reason}") from None
        except json.JSONDecodeError as error:
            raise JudgeCallError(f"{self.url} answered with invalid JSON ({error.msg})") from None
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise JudgeCallError(f"{self.url} answered without choices[0].message.content: "
                                 f"{_first_line(json.dumps(payload))}") from None

    def score_one(self, completion: str, row: Row) -> dict[str, float] | ScoreError:
        """Render, call, parse one sample (runs in the pool)."""
        try:
            prompt = render_judge_prompt(self.options.template, completion, row, "http_judge")
            answer = self.complete(prompt)
        except MissingColumnError as error:
            return ScoreError(str(error))
        except JudgeCallError as error:
            if self.options.on_error == "zero":
                return {"reward": 0.0, "parse_failed": 0.0, "call_failed": 1.0}
            return ScoreError(str(error))
        return {**judge_value(answer, self.options.max_score, self.pattern), "call_failed": 0.0}

    def close(self) -> None:
        """Stop the request pool (calls in flight finish; none waits for new work)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def score_group(self, completions: list[str], rows: list[Row]) -> list[dict[str, float] | ScoreError]:
        """Every sample's call goes to the pool at once; at most `max_concurrency` run together."""
        import asyncio

        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(self.pool, self.score_one, c, r) for c, r in zip(completions, rows)]
        return list(await asyncio.gather(*calls))


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


REWARD_FUNCTIONS.register("llm_judge")(ModelReward("rollflow.rewards.judge:LLMJudge", LLMJudgeOptions))
REWARD_FUNCTIONS.register("http_judge")(ModelReward("rollflow.rewards.judge:HTTPJudge", HTTPJudgeOptions))
