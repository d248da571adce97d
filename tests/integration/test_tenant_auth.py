"""Tenants from API keys on the OpenAI routes: known keys name the tenant, unknown keys get a 401 in
OpenAI's error shape, and without a tenants file everyone is the anonymous tenant."""

from pathlib import Path

import httpx
import openai
import pytest

from specloop.engine.loaders.load import LoadedModel
from tests.integration.conftest import ACME_KEY, CaptureStack, consent_settings, server_settings, serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.parametrize("authorization", ["Bearer not-a-key-of-anyone-at-all", "Basic YWNtZTprZXk=", "Bearer"])
def test_an_unknown_key_is_refused_with_openai_error_json(stack: CaptureStack, authorization: str) -> None:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", headers={"Authorization": authorization},
                   json={"model": stack.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_the_key_is_checked_before_the_body(stack: CaptureStack) -> None:
    r = httpx.post(f"{stack.base_url}/v1/completions", headers={"Authorization": "Bearer wrong-key-wrong-key"},
                   json={"model": stack.model, "prompt": "hi", "max_tokens": -5})
    assert r.status_code == 401, r.text


def test_the_openai_client_authenticates_with_a_tenant_key(stack: CaptureStack) -> None:
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=ACME_KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [stack.model]
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-unknown-key-00000", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_operations_routes_need_no_key(stack: CaptureStack) -> None:
    assert httpx.get(f"{stack.base_url}/health").status_code == 200
    assert httpx.get(f"{stack.base_url}/metrics").status_code == 200


def test_without_a_tenants_file_any_key_is_anonymous_and_nothing_is_captured(
        tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    with serving(tiny_loaded, server_settings(), consent_settings(tmp_path, None)) as (url, app):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-whatever-the-client-sends", max_retries=0) as client:
            r = client.completions.create(model=tiny_loaded.name, prompt="hello", max_tokens=3, user="alice")
        assert r.usage.completion_tokens == 3
        assert "specloop_capture_decisions" not in httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/admin/consents", json={}).status_code == 404
    assert app.state.serving.on_finish is None
