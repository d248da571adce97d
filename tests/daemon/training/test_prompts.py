"""Reading a prompt file: the shipped sets parse, and a limit stops reading where it is reached."""

from pathlib import Path

import pytest

from specloop.daemon.training.prompts import FIRST_DRAFTER, read_prompts


def test_the_first_drafter_set_ships_256_prompts() -> None:
    assert len(read_prompts(FIRST_DRAFTER)) == 256


def test_a_limit_leaves_the_rest_of_the_file_unread(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n' * 3 + "not json\n")
    assert [p.messages[0]["content"] for p in read_prompts(path, 3)] == ["a"] * 3  # the bad line is never read
    with pytest.raises(ValueError, match="p.jsonl:4"):
        read_prompts(path)
