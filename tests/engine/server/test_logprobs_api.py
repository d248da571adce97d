"""Log-probabilities through the official `openai` client: chat and completions, streamed and not,
equal to the log-softmax of the target's logits from a separate forward pass, identical with
speculation on and off at temperature 0; `echo` scores the prompt, with or without new tokens."""

import openai
import pytest
import torch

from tests.engine.server.conftest import FinishHookSpy, RunningServer

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Say hello in three languages."}]
# The tiny random model repeats itself, so n-gram drafts are accepted and verify rows are used.
REPEAT = "one two three one two three one two three one two"


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def reference(server: RunningServer, ids: list[int]) -> torch.Tensor:
    """log-softmax `[len(ids), V]` of one cache-free forward pass; row p scores token p + 1."""
    model = server.loaded.model
    with torch.inference_mode():
        hidden, _ = model(torch.tensor([ids]))
        return torch.log_softmax(model.logits(hidden[0]), dim=-1)


def test_chat_logprobs_are_the_targets(server: RunningServer, hook: FinishHookSpy) -> None:
    r = client(server).chat.completions.create(model=server.model, messages=HELLO, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert server.wait_idle()
    record = hook.calls[-1]  # the token ids the engine emitted, as trace capture sees them
    ref = reference(server, list(record.prompt_ids + record.response_ids))
    for i, (entry, token) in enumerate(zip(content, record.response_ids, strict=True)):
        row = ref[len(record.prompt_ids) - 1 + i]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_chat_stream_carries_the_same_logprobs(server: RunningServer) -> None:
    kwargs = dict(model=server.model, messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client(server).chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for chunk in client(server).chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_with_and_without_speculation(server: RunningServer, spec_server: RunningServer,
                                                                 stream: bool) -> None:
    def run(s: RunningServer) -> tuple[str, list[float], list[int]]:
        kwargs = dict(model=s.model, prompt=REPEAT, max_tokens=12, temperature=0, logprobs=2,
                      extra_body={"ignore_eos": True})
        if not stream:
            choice = client(s).completions.create(**kwargs).choices[0]
            return choice.text, choice.logprobs.token_logprobs, choice.logprobs.text_offset
        text, values, offsets = "", [], []
        for chunk in client(s).completions.create(**kwargs, stream=True):
            if chunk.choices:
                text += chunk.choices[0].text
                if chunk.choices[0].logprobs:
                    values += chunk.choices[0].logprobs.token_logprobs
                    offsets += chunk.choices[0].logprobs.text_offset
        return text, values, offsets

    plain, spec = run(server), run(spec_server)
    assert plain[0] == spec[0] and plain[2] == spec[2] and len(plain[1]) == 12
    assert plain[1] == pytest.approx(spec[1], abs=1e-5)
    ids = server.loaded.tokenizer.encode(REPEAT, add_special_tokens=True)
    ref = reference(server, ids)
    assert plain[1][0] == pytest.approx(ref[-1].max().item(), abs=1e-4)


def test_echo_scores_the_prompt(server: RunningServer) -> None:
    r = client(server).completions.create(model=server.model, prompt=REPEAT, max_tokens=3, temperature=0,
                                          echo=True, logprobs=1, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    ids = server.loaded.tokenizer.encode(REPEAT, add_special_tokens=True)
    assert choice.text.startswith(REPEAT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(server, ids)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
    assert lp.text_offset[len(ids)] == len(REPEAT)  # the completion's first token starts after the prompt


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_no_new_tokens_is_a_score(server: RunningServer, stream: bool) -> None:
    kwargs = dict(model=server.model, prompt=REPEAT, max_tokens=0, echo=True, logprobs=0)
    if stream:
        chunks = [c for c in client(server).completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    else:
        r = client(server).completions.create(**kwargs)
        assert r.usage.completion_tokens == 0
        text, values = r.choices[0].text, r.choices[0].logprobs.token_logprobs
    ids = server.loaded.tokenizer.encode(REPEAT, add_special_tokens=True)
    assert text == REPEAT and len(values) == len(ids) and values[0] is None
    assert sum(values[1:]) == pytest.approx(sum(reference(server, ids)[j - 1, ids[j]].item()
                                                for j in range(1, len(ids))), abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_distinct_and_reproducible_per_index(server: RunningServer, stream: bool) -> None:
    def run(seed: int) -> tuple[list[str], int]:
        kwargs = dict(model=server.model, messages=HELLO, max_tokens=12, temperature=1.0, n=4, seed=seed,
                      stream_options={"include_usage": True} if stream else None, extra_body={"ignore_eos": True})
        if not stream:
            r = client(server).chat.completions.create(**{k: v for k, v in kwargs.items() if v is not None})
            return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)], r.usage.completion_tokens
        texts, usage = [""] * 4, 0
        for chunk in client(server).chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return texts, usage

    first, tokens = run(11)
    assert len(set(first)) == 4 and tokens == 4 * 12  # four samples; usage counts every choice
    assert run(11)[0] == first
    # Choice i is seed + i: the second choice of seed 11 is the first of seed 12.
    assert run(12)[0][0] == first[1]
