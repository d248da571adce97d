"""Server settings: `SPECLOOP_*` environment variables, overrides, and errors that name the field."""

import pytest
import torch
from pydantic import ValidationError

from specloop.engine.server.settings import ServerSettings


def test_defaults_serve_on_loopback() -> None:
    s = ServerSettings()
    assert (s.host, s.port, s.model, s.speculate) == ("127.0.0.1", 8000, None, True)
    assert s.torch_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_environment_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECLOOP_PORT", "9001")
    monkeypatch.setenv("SPECLOOP_DTYPE", "float32")
    monkeypatch.setenv("SPECLOOP_SPECULATE", "false")
    s = ServerSettings(num_slots=3)
    assert (s.port, s.torch_dtype(), s.speculate, s.num_slots) == (9001, torch.float32, False, 3)
    assert s.engine_config().num_slots == 3 and not s.engine_config().speculate


@pytest.mark.parametrize("field, value", [
    ("port", 70000), ("dtype", "float16"), ("device", "gpu9"), ("num_slots", 0), ("max_len", 1),
    ("drafter", "/nonexistent/drafter"), ("suffix_cache_tokens", 0), ("proposer", "medusa"),
])
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as e:
        ServerSettings(**{field: value})
    assert e.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("kind", ["dflash", "combined", "dflash+suffix"])
def test_learned_proposers_need_a_drafter(kind: str) -> None:
    with pytest.raises(ValidationError, match="needs a drafter"):
        ServerSettings(proposer=kind)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_lookups_alone_do_not_follow_a_registry(kind: str) -> None:
    with pytest.raises(ValidationError, match="uses no drafter"):
        ServerSettings(proposer=kind, registry="sqlite:///x.db")
    assert ServerSettings(proposer=kind).proposer_kind() == kind


def test_lookup_block_size_is_checked() -> None:
    assert ServerSettings(proposer="ngram", block_size=4).block_size == 4
    with pytest.raises(ValidationError, match="block_size"):
        ServerSettings(proposer="ngram", block_size=1)
