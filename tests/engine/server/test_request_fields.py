"""Nothing a client sends is silently ignored: OpenAI fields not built yet are refused unless neutral,
descriptive ones are accepted, unknown ones are unrecognized; and a fuzz of every request field with
wrong types and out-of-range values gets a 4xx naming the field, never a 5xx, never a hang."""

import json
import random

import httpx
import jsonschema
import openai
import pytest

from specloop.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.engine.server.conftest import RunningServer

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def base(server: RunningServer, path: str) -> dict:
    body = {"model": server.model, "max_tokens": 2, "ignore_eos": True}
    return {**body, "messages": HELLO} if path == CHAT else {**body, "prompt": "hi"}


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


@pytest.mark.parametrize("path, field, value", [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (CHAT, "tool_choice", "required"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "presence_penalty", 0.5),
    (CHAT, "frequency_penalty", -1.0),
    (CHAT, "logit_bias", {"5": 100}),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "web_search_options", {}),
    (COMPLETIONS, "suffix", "end"),
    (COMPLETIONS, "best_of", 3),
    (COMPLETIONS, "presence_penalty", 1.0),
])
def test_fields_that_change_the_output_are_refused_unless_built(server: RunningServer, path: str, field: str,
                                                                 value: object) -> None:
    r = post(server, path, {**base(server, path), field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "not supported by this server yet" in error["message"]


@pytest.mark.parametrize("path, extra", [
    (CHAT, {"user": "u-1", "metadata": {"team": "search"}, "store": False, "service_tier": "auto"}),
    (CHAT, {"logprobs": False, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none", "parallel_tool_calls": False, "presence_penalty": 0, "frequency_penalty": 0,
            "logit_bias": {}, "modalities": ["text"], "n": 1, "stream_options": {"include_usage": True}}),
    (COMPLETIONS, {"best_of": 1, "suffix": "", "logit_bias": {}, "user": "u", "metadata": {}}),
])
def test_descriptive_and_neutral_fields_are_accepted(server: RunningServer, path: str, extra: dict) -> None:
    r = post(server, path, {**base(server, path), **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_fields_are_unrecognized_arguments(server: RunningServer, path: str) -> None:
    r = post(server, path, {**base(server, path), "repetition_penalty": 1.3})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "repetition_penalty" and "unrecognized request argument" in error["message"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_with_and_without_speculation(server: RunningServer, spec_server: RunningServer,
                                                                   stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    texts = []
    for s in (server, spec_server):
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
        kwargs = dict(model=s.model, messages=HELLO, max_tokens=60, temperature=0, response_format=fmt)
        if stream:
            texts.append("".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                **kwargs, stream=True) if c.choices))
        else:
            r = client.chat.completions.create(**kwargs)
            assert r.choices[0].finish_reason == "stop"
            texts.append(r.choices[0].message.content)
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert texts[0] == texts[1]  # greedy: speculation changes nothing


def test_json_object_mode_gives_an_object(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=80, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens inside the object: still a prefix of one
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, {"type": "json_object", "json_schema": {"name": "x"}},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
                                 {"type": "yaml"}])
def test_unusable_response_formats_are_400(server: RunningServer, fmt: dict) -> None:
    r = post(server, CHAT, {**base(server, CHAT), "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


BAD_VALUES = ["x", -1, -(10 ** 12), 10 ** 12, 2.5, -0.5, True, [], [1, "a"], {}, {"a": [1]}, None, "", [None]]


@pytest.mark.parametrize("path, request_model", [(CHAT, ChatCompletionRequest), (COMPLETIONS, CompletionRequest)])
def test_fuzzing_every_field_gives_4xx_naming_it_and_never_5xx(server: RunningServer, path: str,
                                                                request_model: type) -> None:
    rng = random.Random(7)
    bodies = [(field, value) for field in request_model.model_fields for value in BAD_VALUES]
    bodies += [(field, rng.choice(BAD_VALUES)) for field in ("nonexistent", "messages.0", "prompt") for _ in range(3)]
    statuses = []
    for field, value in bodies:
        body = {**base(server, path), field: value}
        r = post(server, path, body)
        statuses.append(r.status_code)
        assert r.status_code < 500, (field, value, r.text)
        if r.status_code != 200:
            error = r.json()["error"]
            assert 400 <= r.status_code < 500 and error["param"] is not None, (field, value, r.text)
            assert error["param"] == field or field == "model" or error["param"] in r.text, (field, value, r.text)
    assert statuses.count(400) > len(statuses) / 2  # most of these values are wrong for most fields
