"""Moving the registry's aliases, each move recorded in the promotion history with its reason.

`promote` points `champion` at a version and tags it with the champion it replaced (the engines
follow the alias and hot-swap); `await_approval` points `challenger` at it and leaves `champion`
alone; `settle_approval` acts on a person's answer (the `approval` tag, set in the MLflow UI or
by `specloop approve`): approved is promoted, rejected is recorded and `challenger` removed;
`roll_back` returns `champion` to the version before. The alias moves first and the history row
after: a crash between the two leaves a promotion without its row, never a row for a promotion
that did not happen, and the version's own tags still say what it replaced.

Not here: whether to promote or roll back (`gate.py`, `rollback.py`).
"""

import logging

from specloop.daemon.retrain.history import Action, Event, PromotionHistory
from specloop.storage.registry import CHALLENGER, CHAMPION, Approval, DrafterRegistry, DrafterVersion, Tag

log = logging.getLogger(__name__)


def promote(registry: DrafterRegistry, history: PromotionHistory, v: DrafterVersion, reason: str,
            actor: str = "daemon", run_id: str | None = None) -> Event:
    previous = registry.champion(v.base_model)
    if previous is not None and previous.version != v.version:
        registry.set_tags(v.base_model, v.version, {Tag.PREVIOUS_CHAMPION: previous.version})
    registry.set_alias(v.base_model, CHAMPION, v.version)
    if CHALLENGER in v.aliases or _challenger_is(registry, v):
        registry.delete_alias(v.base_model, CHALLENGER)
    before = None if previous is None else previous.label
    log.info("promoted %s to champion of %s (was %s): %s", v.label, v.base_model, before or "none", reason)
    return history.record(v.base_model, Action.PROMOTED, v.label, reason, previous=before, actor=actor,
                          run_id=run_id)


def await_approval(registry: DrafterRegistry, history: PromotionHistory, v: DrafterVersion, reason: str,
                   run_id: str | None = None) -> Event:
    registry.set_alias(v.base_model, CHALLENGER, v.version)
    champion = registry.champion(v.base_model)
    log.info("%s of %s is the challenger, waiting for approval: %s", v.label, v.base_model, reason)
    return history.record(v.base_model, Action.AWAITING_APPROVAL, v.label, reason,
                          previous=None if champion is None else champion.label, run_id=run_id)


def settle_approval(registry: DrafterRegistry, history: PromotionHistory, base_model: str) -> Event | None:
    """Promote or drop the `challenger` once a person answered; None while it is pending (or absent)."""
    challenger = registry.by_alias(base_model, CHALLENGER)
    if challenger is None or challenger.approval in (None, Approval.PENDING):
        return None
    run_id = challenger.tags.get(Tag.RUN)
    if challenger.approval is Approval.APPROVED:
        return promote(registry, history, challenger, "approved by a person (approval=approved)", "approval", run_id)
    registry.delete_alias(base_model, CHALLENGER)
    log.info("%s of %s was rejected; it will not be promoted", challenger.label, base_model)
    said = history.last(base_model)
    if said is not None and said.action is Action.REJECTED and said.version == challenger.label:
        return said  # `specloop approve --reject` recorded it, with who
    champion = registry.champion(base_model)
    return history.record(base_model, Action.REJECTED, challenger.label, "rejected by a person (approval=rejected)",
                          previous=None if champion is None else champion.label, actor="approval", run_id=run_id)


def roll_back(registry: DrafterRegistry, history: PromotionHistory, base_model: str, bad: str, previous: str,
              reason: str) -> Event:
    """`champion` from version `bad` back to `previous` (MLflow version numbers, "3")."""
    registry.set_tags(base_model, bad, {Tag.ROLLED_BACK: reason})
    registry.set_alias(base_model, CHAMPION, previous)
    log.warning("rolled back champion of %s from v%s to v%s: %s", base_model, bad, previous, reason)
    return history.record(base_model, Action.ROLLED_BACK, f"v{bad}", reason, previous=f"v{previous}")


def _challenger_is(registry: DrafterRegistry, v: DrafterVersion) -> bool:
    current = registry.by_alias(v.base_model, CHALLENGER)
    return current is not None and current.version == v.version
