"""The OpenAI-compatible API, driven by the official `openai` client against a real uvicorn server.

Greedy runs of the tiny random model repeat one token, so tests that need varied text (stop
strings, streamed pieces that must add up) sample with a fixed seed instead.
"""

import asyncio

import httpx
import openai
import pytest

from tests.engine.server.conftest import MAX_LEN, FinishHookSpy, RunningServer, metric

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Say hello in three languages."}]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat_prompt_ids(server: RunningServer, messages: list[dict[str, str]]) -> list[int]:
    tok = server.loaded.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def test_models_lists_the_served_model_with_its_fingerprint(server: RunningServer) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].fingerprint == server.loaded.fingerprint
    assert models[0].max_model_len == MAX_LEN


def test_chat_completion_reports_usage_and_length(server: RunningServer) -> None:
    r = client(server).chat.completions.create(model=server.model, messages=HELLO, max_tokens=7, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_prompt_ids(server, HELLO))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.system_fingerprint == server.loaded.fingerprint


def test_chat_stream_equals_the_non_streamed_text(server: RunningServer) -> None:
    kwargs = dict(model=server.model, messages=HELLO, max_tokens=40, temperature=1.0, seed=3)
    whole = client(server).chat.completions.create(**kwargs)
    chunks = list(client(server).chat.completions.create(**kwargs, stream=True,
                                                         stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_accepts_text_or_token_ids(server: RunningServer) -> None:
    prompt = "The capital of France is"
    ids = server.loaded.tokenizer.encode(prompt, add_special_tokens=True)
    by_text = client(server).completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    by_ids = client(server).completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_completion_defaults_to_openais_16_tokens(server: RunningServer) -> None:
    r = client(server).completions.create(model=server.model, prompt="Once upon a time", temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_stream(server: RunningServer) -> None:
    kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=30, temperature=0.8, seed=11)
    whole = client(server).completions.create(**kwargs)
    chunks = list(client(server).completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seed_reproduces_a_sampled_completion(server: RunningServer) -> None:
    def sample(seed: int) -> str:
        return client(server).chat.completions.create(model=server.model, messages=HELLO, max_tokens=20,
                                                      temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_output_before_it(server: RunningServer, stream: bool) -> None:
    kwargs = dict(model=server.model, messages=HELLO, max_tokens=60, temperature=1.0, seed=5)
    full = client(server).chat.completions.create(**kwargs).choices[0].message.content
    stop = full[20:24]
    assert len(stop) == 4, "the sampled text is long enough to pick a stop string from"
    r = client(server).chat.completions.create(**kwargs, stop=[stop, "never appears \u2603"], stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == full[:full.index(stop)]
    assert reason == "stop"
    assert server.wait_idle()


def test_concurrent_requests_match_one_at_a_time(server: RunningServer) -> None:
    prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in range(6)]

    async def run(concurrently: bool) -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

        async def one(messages: list[dict[str, str]]) -> str:
            r = await aclient.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                                      temperature=0.7, seed=1)
            return r.choices[0].message.content

        async with aclient:
            if concurrently:
                return list(await asyncio.gather(*(one(p) for p in prompts)))
            return [await one(p) for p in prompts]

    assert asyncio.run(run(concurrently=True)) == asyncio.run(run(concurrently=False))


def test_finished_requests_reach_the_hook(server: RunningServer, hook: FinishHookSpy) -> None:
    r = client(server).chat.completions.create(model=server.model, messages=HELLO, max_tokens=5, temperature=0,
                                               user="alice")
    (done,) = hook.calls
    # Without a tenants file every caller is the anonymous tenant (tenants come from API keys).
    assert done.endpoint == "chat.completions" and done.user == "alice" and done.tenant == "anonymous"
    assert list(done.prompt_ids) == chat_prompt_ids(server, HELLO)
    assert len(done.response_ids) == r.usage.completion_tokens
    assert done.response_text == r.choices[0].message.content
    assert done.fingerprint == server.loaded.fingerprint and done.params.max_tokens == 5
    assert done.arrived_at <= done.first_token_at <= done.finished_at


def test_a_failing_hook_does_not_break_the_response(server: RunningServer, hook: FinishHookSpy) -> None:
    hook.fail = True
    before = metric(server, "specloop_finish_hook_errors_total")
    r = client(server).completions.create(model=server.model, prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert metric(server, "specloop_finish_hook_errors_total") == before + 1


def test_speculation_stats_in_usage_and_metrics(server: RunningServer, spec_server: RunningServer) -> None:
    kwargs = dict(messages=HELLO, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    plain = client(server).chat.completions.create(model=server.model, **kwargs)
    spec = client(spec_server).chat.completions.create(model=spec_server.model, **kwargs)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    s = spec.usage.speculation
    assert s["drafts"] > 0 and s["drafts"] <= s["draft_tokens"] <= 3 * s["drafts"]  # block_size 4: 3 drafts
    assert 0 <= s["accepted_tokens"] <= s["draft_tokens"]
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"])
    assert plain.usage.speculation is None
    assert metric(spec_server, "specloop_spec_decode_num_drafts_total") >= s["drafts"]
    assert metric(spec_server, "specloop_spec_decode_num_accepted_tokens_total") >= s["accepted_tokens"]


# ---------------------------------------------------------------------------------------------- bad input


def _post(server: RunningServer, path: str, body: dict | None = None, timeout: float = 10) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "M"}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "n": 0}, "n"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "n": 17}, "n"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "seed": 2 ** 64}, "seed"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "stop": ""}, "stop"),
    ("/v1/chat/completions", {"messages": HELLO}, "model"),
    ("/v1/completions", {"model": "M", "prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [1, -5]}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 0}, "echo"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "M", "messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
])
def test_invalid_fields_are_400_naming_the_field(server: RunningServer, path: str, body: dict, param: str) -> None:
    body = {**body, "model": server.model} if "model" in body else body
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert param in err["message"]


def test_openai_client_raises_bad_request(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=server.model, messages=HELLO, temperature=3)
    assert e.value.body["param"] == "temperature"


def test_over_long_prompt_is_context_length_exceeded(server: RunningServer) -> None:
    long = [{"role": "user", "content": "word " * MAX_LEN}]
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=server.model, messages=long, stream=True)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": [1] * MAX_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_max_tokens_past_the_context_is_refused(server: RunningServer) -> None:
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": MAX_LEN})
    assert r.status_code == 400
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                   "param": "max_tokens", "code": "context_length_exceeded"}


def test_unknown_model_is_404(server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client(server).chat.completions.create(model="gpt-7", messages=HELLO)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("content, headers", [
    (b'{"model": "x", "messages": [', {"content-type": "application/json"}),
    (b"model=x", {"content-type": "application/x-www-form-urlencoded"}),
    (b"", {"content-type": "application/json"}),
])
def test_malformed_body_is_400(server: RunningServer, content: bytes, headers: dict[str, str]) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=content, headers=headers, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_wrong_routes_and_methods(server: RunningServer) -> None:
    r = httpx.get(f"{server.base_url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={})
    assert r.status_code == 404 and "error" in r.json()


# ------------------------------------------------------------------------------------------ disconnects


def test_client_disconnect_mid_stream_frees_the_slot(server: RunningServer, hook: FinishHookSpy,
                                                     slow_decode: None) -> None:
    body = {"model": server.model, "messages": HELLO, "stream": True, "temperature": 0, "ignore_eos": True}
    before = metric(server, "specloop_requests_total", endpoint="chat.completions", status="499")
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        events = (line for line in r.iter_lines() if line)
        assert all(next(events).startswith("data: {") for _ in range(3))
    assert server.wait_idle(), "the aborted request still holds its slot"
    assert hook.calls == [], "an aborted request is not a finished one"
    assert metric(server, "specloop_requests_total", endpoint="chat.completions", status="499") == before + 1


def test_client_disconnect_while_waiting_for_a_whole_response(server: RunningServer, hook: FinishHookSpy,
                                                              slow_decode: None) -> None:
    body = {"model": server.model, "prompt": "x", "max_tokens": MAX_LEN - 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", body, timeout=0.3)
    assert server.wait_idle(), "the abandoned request still holds its slot"
    assert hook.calls == []


# ------------------------------------------------------------------------------------ health and metrics


def test_health_and_ready(server: RunningServer) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{server.base_url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_metrics_count_requests_tokens_and_latency(server: RunningServer) -> None:
    before = metric(server, "specloop_generation_tokens_total")
    ok = metric(server, "specloop_requests_total", endpoint="completions", status="200")
    client(server).completions.create(model=server.model, prompt="hi", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    _post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "temperature": 9})
    assert metric(server, "specloop_generation_tokens_total") == before + 4
    assert metric(server, "specloop_requests_total", endpoint="completions", status="200") == ok + 1
    assert metric(server, "specloop_requests_total", endpoint="completions", status="400") >= 1
    assert metric(server, "specloop_time_to_first_token_seconds_count", endpoint="completions") >= 1
    assert metric(server, "specloop_inter_token_latency_seconds_count") >= 3
    assert metric(server, "specloop_kv_cache_slots_total") == server.engine.config.num_slots
    assert metric(server, "specloop_num_requests_running") == 0
    assert metric(server, "specloop_engine_steps_total") > 0
