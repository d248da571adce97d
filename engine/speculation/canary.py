"""The canary: fixed probe prompts on which a drafter version must draft as well when it serves as it
did when it was promoted.

A version's weights can be lost between training and serving while every load check passes: SGLang
users saw acceptance fall to 1.0 after a drafter reload (sgl-project/sglang#31674), vLLM users saw it
collapse after weight updates, with no error either time. So the daemon measures each version's τ on
these probes when it registers it (greedy answers of the target, replayed with the combined
proposer; the `tau_canary` tag), and an engine that has just swapped the version in runs the same
probes through itself: greedy decoding commits exactly what the replay counts, so the two agree up
to numerics. Far less (`MIN_RATIO`) and the engine swaps back at once; the daemon then rolls the
alias back and records why. The probes are generic prompts, never anyone's data: the tag travels
with the version to every engine.

Not here: running them (`engine/server/drafter_follower.py` in an engine, `daemon/evaluation/canary.py`
at registration).
"""

from typing import Protocol

PROBES = (
    "Explain how a hash table works.",
    "Write a Python function that reverses a string.",
    "What are the main causes of the seasons on Earth?",
    "List five uses of a paperclip.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do I convert Celsius to Fahrenheit?",
)
PROBE_TOKENS = 48  # each probe's greedy answer at most: 6 × 48 tokens take a few seconds on 2 cores
# Live τ below this share of the promoted one fails. The shipped drafter with n-gram lookup replays
# τ 1.430 on these probes with the target in bf16 and in fp32 alike (Zen 3); with its weights zeroed,
# 1.104 (0.77 of it; n-gram lookup alone 1.243). Numerics of another CPU or dtype move τ by less than
# the 10% this allows.
MIN_RATIO = 0.9


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def probe_prompts(tokenizer: ChatTokenizer) -> list[list[int]]:
    """The probes as the served model sees them: chat-templated and tokenized."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True), add_special_tokens=False)
            for p in PROBES]


def judge(live_tau: float, promoted_tau: float) -> str | None:
    """Why a version failed its canary, or None when it drafts as promoted."""
    if live_tau < MIN_RATIO * promoted_tau:
        return (f"live τ {live_tau:.3f} on the canary probes, below {MIN_RATIO} × the {promoted_tau:.3f} "
                f"measured when it was registered")
    return None
