"""The verify rule: the one place that decides which drafted tokens a verify pass commits, losslessly.

"Acceptance" elsewhere means the measured numbers (τ, acceptance rate; docs/architecture.md,
"Acceptance numbers"); this file is the rule that produces them.

A verify pass feeds the target the block `[t, d_1 .. d_k]`, where `t` is the last committed token
and `d_i` are drafts. Position i of the output is the target's distribution for the token after
`t, d_1 .. d_i`. The target samples its own token `x_i` at every position (argmax when greedy), and
we accept drafts while `d_{i+1} == x_i`:

    accepted n = max { n : d_1..d_n == x_0..x_{n-1} },   commit d_1..d_n, x_n

Why this is exactly the target's distribution, at any temperature: `x_0` is drawn from
p(· | prefix). If it equals `d_1`, the prefix the target conditioned position 1 on is exactly the
prefix plain decoding would have, so `x_1` is a fair draw from p(· | prefix, x_0), and so on. The
first mismatching `x_n` is itself a fair draw (the bonus token), and later positions, conditioned
on a rejected draft, are thrown away. Every committed token is a target sample given committed
tokens only; the drafts merely decide how many of those samples one pass may keep. With argmax
drafts this accepts less often than rejection sampling (Leviathan et al.) would at temperature > 0,
but it needs no draft probabilities and is trivially exact.

Cache rollback: the pass wrote K/V for all k+1 block positions; only `t, d_1..d_n` stay, so the
caller sets `num_cached += n + 1` and the dead rows are overwritten later.
"""

import torch


def accept_lengths(drafts: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """How many drafts each row keeps.

    drafts `[B, k]`, target `[B, k+1]` (the target's token at every block position), allowed `[B]`
    (at most this many drafts may be kept, e.g. because max_tokens is near) → `[B]` long.
    """
    B, k = drafts.shape
    assert target.shape == (B, k + 1) and allowed.shape == (B,)
    matches = (drafts == target[:, :k]).long()  # [B, k]
    # cumprod turns the first mismatch and everything after it into zeros.
    accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    return torch.minimum(accepted, allowed)


def committed_tokens(drafts: torch.Tensor, target: torch.Tensor, accepted: torch.Tensor) -> list[list[int]]:
    """The tokens each row commits: its accepted drafts, then the target's own token after them."""
    rows = []
    for b, n in enumerate(accepted.tolist()):
        rows.append(drafts[b, :n].tolist() + [int(target[b, n])])
    return rows
