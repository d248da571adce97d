"""Telling the engines that what they should serve changed: after the daemon moves `champion`
(promotion, approval, rollback, an erasure's revert) or benches it, each engine of
`SPECLOOP_DAEMON_ENGINES` is asked to look at the registry now (`POST /admin/drafter/reload`,
engine/server/drafter_admin.py) instead of at its next poll (`SPECLOOP_REGISTRY_POLL_S`, 30 s).

A notice is a hint, never the truth: an engine looks the alias up itself, with every check it makes
at a poll. One that misses the notice (down, restarting, unreachable) finds the change at its next
poll, so a failed notice is logged and counted, never raised into the daemon's job. Notices go out on
a thread of their own, to every engine at once, since an engine answers once its swap is done
(seconds), and again a few seconds apart while it answers that it could not read the registry;
changes made while a round is out are coalesced into one more round. They are
authenticated with the engines' admin token: `SPECLOOP_ADMIN_TOKEN`, else the consent secrets file the
engines share (`ConsentSettings.existing_admin_token`), read at each round and never created here.

Why not MLflow's webhooks (3.3+, on alias and tag changes, HMAC-signed): MLflow 3.17 delivers them
only over https and only to public addresses, unless the server's SSRF guard is lifted for every
webhook with a private variable (`_MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS`), and engines sit on private
addresses in every shape deploy/ ships. The daemon already names each engine (it reads their
/metrics), so it tells them itself.

Not here: deciding what serves (`gate.py`, `rollback.py`, the contest's bench), the engine's look
(`engine/server/drafter_follower.py`).
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence

import httpx
from prometheus_client import Counter

log = logging.getLogger(__name__)

# An engine's look downloads a version (tens of MB) and waits for the swap: seconds, bounded here.
ANSWER_TIMEOUT_S = 120.0
# An engine that could not read the registry (503: MLflow slow under load, or just back) is asked
# again after these pauses, before its poll is left to find the change.
UNAVAILABLE_RETRY_S = (2.0, 4.0, 8.0)


class EngineNotice:
    """Call it with the base model whose serving changed; `close()` ends its thread."""

    def __init__(self, engines: Sequence[str], token: Callable[[], str | None], counted: Counter,
                 retry_s: Sequence[float] = UNAVAILABLE_RETRY_S) -> None:
        self.engines = list(engines)
        self._retry_s = tuple(retry_s)
        self._token = token
        self._counted = counted  # labelled by result: answered, refused, unreached, no_token
        self._due = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def __call__(self, base_model: str) -> None:
        if not self.engines or self._closed:
            return
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._rounds, name="engine-notice", daemon=True)
                self._thread.start()
        log.info("telling %d engines that %s's champion changed", len(self.engines), base_model)
        self._due.set()

    def close(self) -> None:
        """Ends the thread after the round it is in, without waiting for it: a stopping daemon's budget
        is for its run, and an engine that misses the notice finds the change at its poll."""
        self._closed = True
        self._due.set()

    def _rounds(self) -> None:
        while True:
            self._due.wait()
            if self._closed:
                return
            self._due.clear()
            self._round()

    def _round(self) -> None:
        try:
            token = self._token()
        except (OSError, ValueError) as e:  # an unreadable secrets file: the engines' polls still work
            log.warning("no engine told (the admin token is unreadable: %s); they look at their next poll", e)
            token = None
        if token is None:
            self._counted.labels("no_token").inc(len(self.engines))
            log.warning("no engine told (no admin token yet); they look at their next poll")
            return
        asks = [threading.Thread(target=self._tell, args=(url, token), name=f"notice {url}") for url in self.engines]
        for ask in asks:
            ask.start()
        for ask in asks:
            ask.join()

    def _tell(self, url: str, token: str) -> None:
        for pause in (*self._retry_s, None):
            try:
                r = httpx.post(f"{url}/admin/drafter/reload", headers={"Authorization": f"Bearer {token}"},
                               json={}, timeout=ANSWER_TIMEOUT_S)
            except httpx.HTTPError as e:
                self._counted.labels("unreached").inc()
                log.info("engine %s not told (%s: %s); it looks at its next poll", url, type(e).__name__, e)
                return
            if r.status_code != 503 or pause is None or self._closed:
                break
            log.info("engine %s could not read the registry; asking again in %.0f s", url, pause)
            time.sleep(pause)
        if r.status_code != 200:
            self._counted.labels("refused").inc()
            log.warning("engine %s answered the notice with %d: %s", url, r.status_code, r.text[:200])
            return
        self._counted.labels("answered").inc()
        log.info("engine %s looked: %s", url, r.text[:200])
