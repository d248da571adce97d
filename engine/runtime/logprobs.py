"""Log-probabilities of the tokens a sequence emits (and of its prompt, for echo): the target's own
distribution at each position, with its most likely alternatives.

The values are the log-softmax of the target's raw logits, before temperature, top-k and top-p, as
vLLM reports by default: what the model thinks of the token, not how this request sampled it.

With speculation they are plain decoding's. A verify pass computes the target's logits at every
block position, and position i is the distribution of the token after the committed prefix and the
drafts accepted before it; for a committed token that is exactly the prefix plain decoding would
have had (`engine/speculation/verify.py`). So each committed token's row is the row plain decoding
computes, bit for bit where a token's logits do not depend on its block (the C++ decoder's
guarantee, `kernels/cpu_decode.cpp`) and to rounding where they may (eager GEMMs over blocks of
several rows).

This file computes; the wire formats are the server's (`engine/server/logprobs_format.py`).
"""

from dataclasses import dataclass

import torch

MAX_TOP = 20  # OpenAI's limit for chat's top_logprobs (completions allow 5)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `k` most likely tokens and their log-probabilities, best first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits `[n, V]` (fp32) at the positions that produced `tokens` (n of them) → one entry each,
    with the `k` most likely alternatives."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens) and 0 <= k <= MAX_TOP
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).view(-1, 1)).squeeze(1).tolist()  # [n]
    if k:
        top_values, top_ids = (t.tolist() for t in logp.topk(k, dim=-1))  # [n, k] each
    else:
        top_values, top_ids = [[]] * len(tokens), [[]] * len(tokens)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, top_ids, top_values)]
