"""Drafter data: JSONL/Parquet reading, digest, held-out split, prompt sources."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specloop.daemon.traffic.sender import traffic_split
from specloop.daemon.training.prompts import humaneval_prompts, prompt_set, sample_evals_prompts
from specloop.storage.sequences import TokenSequence, digest, read_sequences, split_heldout, write_jsonl

pytestmark = pytest.mark.timeout(30)

SEQS = [TokenSequence((1, 2), (3, 4)), TokenSequence((5,), (6, 7, 8))]


def test_jsonl_and_parquet_read_the_same_sequences(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", SEQS)
    part = tmp_path / "pq" / "base_model=fp" / "dt=2026-01-01"
    part.mkdir(parents=True)
    table = pa.table({"prompt_token_ids": [list(s.prompt) for s in SEQS],
                      "response_token_ids": [list(s.response) for s in SEQS], "text": ["x", "y"]})
    pq.write_table(table, part / "f.parquet")
    assert read_sequences([tmp_path / "a.jsonl"]) == SEQS
    assert read_sequences([tmp_path / "pq"]) == SEQS
    assert digest(SEQS) == digest(read_sequences([tmp_path / "a.jsonl"])) != digest(SEQS[::-1])


def test_bad_records_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_token_ids": [1], "response_token_ids": "no"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'response_token_ids'"):
        read_sequences([tmp_path / "bad.jsonl"])
    with pytest.raises(ValueError, match="does not exist"):
        read_sequences([tmp_path / "missing.jsonl"])


def test_a_directory_of_jsonl_names_its_files_instead_of_reading_them(tmp_path: Path) -> None:
    # `generate --out` writes train.jsonl beside heldout.jsonl: the directory must not read as one set.
    write_jsonl(tmp_path / "train.jsonl", SEQS)
    write_jsonl(tmp_path / "heldout.jsonl", SEQS[:1])
    named = r"holds no Parquet files; pass JSONL files one by one \(.*heldout.jsonl, .*train.jsonl\)"
    with pytest.raises(ValueError, match=named):
        read_sequences([tmp_path])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no Parquet files$"):
        read_sequences([tmp_path / "empty"])


def test_heldout_split_keeps_a_prompt_on_one_side() -> None:
    seqs = [TokenSequence((i,), (1, 2)) for i in range(200)] + [TokenSequence((7,), (9, 9))]
    train, held = split_heldout(seqs, 0.2)
    assert 20 < len(held) < 60 and len(train) + len(held) == len(seqs)
    sides = {s.response for s in (train if TokenSequence((7,), (1, 2)) in train else held) if s.prompt == (7,)}
    assert sides == {(1, 2), (9, 9)}
    assert split_heldout(held, 0.5, salt="again")[1]  # a salted split of a held-out side is not empty


def test_humaneval_prompts_come_from_the_wheel() -> None:
    prompts = humaneval_prompts()
    assert len(prompts) == 164 and prompts[0].task == "HumanEval/0"
    assert "def has_close_elements" in prompts[0].messages[0]["content"]


def test_evals_sampling_per_task(tmp_path: Path) -> None:
    chat = [{"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]}
            for i in range(20)]
    (tmp_path / "task_a").mkdir()
    (tmp_path / "task_a" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in chat) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"input": "plain"}) + "\n" + json.dumps({"other": 1}) + "\n")
    prompts = sample_evals_prompts(tmp_path, per_task=5, seed=1)
    assert [p.task for p in prompts].count("task_a/samples") == 5
    assert [p.messages for p in prompts if p.task == "b"] == [({"role": "user", "content": "plain"},)]
    assert prompts == sample_evals_prompts(tmp_path, per_task=5, seed=1)


def test_the_shipped_formal_logic_prompts_give_the_demo_its_split() -> None:
    prompts = prompt_set("formal-logic")
    assert len(prompts) == 220 and len({json.dumps(p.messages) for p in prompts}) == 220
    assert all([m["role"] for m in p.messages] == ["system", "user"] for p in prompts)
    assert all("logic expression is true or false" in p.messages[1]["content"] for p in prompts)
    traffic, heldout = traffic_split(prompts, 0.25)  # as `specloop replay` splits them
    assert (len(traffic), len(heldout)) == (151, 69)  # the demo policy triggers at 90 new traces


def test_prompt_sources_refuse_a_misplaced_or_missing_file(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert [p.messages for p in prompt_set("file", tmp_path / "p.jsonl")] == [({"role": "user", "content": "hi"},)]
    with pytest.raises(ValueError, match="prompts_file: only read with source 'file'"):
        prompt_set("humaneval", tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="prompts_file: source 'file' needs one"):
        prompt_set("file")
    with pytest.raises(ValueError, match="prompts_file: .*No such file"):
        prompt_set("file", tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="source: 'gsm8k' is not one of"):
        prompt_set("gsm8k")  # type: ignore[arg-type]
