"""`specloop replay`: consented demo traffic sent to a running engine from a prompt set.

The demo retrains the drafter on captured traces, so it needs traffic whose domain differs from the
shipped drafter's (trained on OpenAI `evals` chat prompts): by default HumanEval code prompts. The
command grants consent for a few demo users through the engine's consent admin API, then sends the
prompts as non-streaming greedy chat requests from a thread pool, one JSONL record per finished
request, with a one-line progress display on stderr and a JSON summary on stdout.

A deterministic share of the prompts, chosen by a hash of their messages, is held out and never sent
(`traffic_split`), so τ can be measured on prompts the retraining never saw; the daemon's demo
measurement splits with the same function. This file is an HTTP client only: it knows the engine
through its API, not its code, and it does not measure τ offline (that is `daemon/evaluation/`).
"""

import hashlib
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Self

import typer

from specloop.daemon.training.prompts import Prompt, PromptSource

if TYPE_CHECKING:
    import httpx
    from rich.progress import Progress

log = logging.getLogger(__name__)

CONSENT_SOURCE = "specloop_replay"  # the `source` of the grants this command makes, so it finds its own
ROLLING_WINDOW = 20  # requests in the progress line's rolling τ
VERSION_POLL_S = 2.0
# A refused connection fails in microseconds; without a pause a worker would record thousands of
# failures a second while the engine restarts.
UNREACHABLE_PAUSE_S = 1.0
PAUSE_POLL_S = 2.0  # how often --pause-while-training asks the daemon whether a run is in progress


class ReplayFailed(Exception):
    """The engine cannot be used (gone, or without the consent admin API): the command exits 1."""


def traffic_split(prompts: Sequence[Prompt], heldout_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(traffic, held-out) by a sha256 of each prompt's messages: the same prompt always lands on the
    same side, whatever the other prompts or their order, so a held-out prompt is never sent."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"held-out fraction must be in [0, 1), got {heldout_fraction}")
    traffic, heldout = [], []
    for p in prompts:
        key = json.dumps(p.messages, sort_keys=True, ensure_ascii=False).encode()
        bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
        (heldout if bucket < heldout_fraction else traffic).append(p)
    return traffic, heldout


# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Job:
    prompt: Prompt
    user: str


@dataclass(frozen=True)
class RequestOutcome:
    """One finished request, as recorded. `status` is None when no HTTP response came at all."""

    at: str  # ISO 8601 UTC of the finish
    task: str
    user: str
    latency_s: float
    status: int | None
    completion_tokens: int = 0
    drafts: int = 0
    accepted_tokens: int = 0
    tau: float | None = None  # None for a failure; 1 when nothing was drafted (docs/architecture.md)
    drafter_version: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


def pooled_tau(outcomes: Iterable[RequestOutcome]) -> float | None:
    """τ over many requests, counters summed first: 1 + accepted / drafts; None without a success."""
    ok = [o for o in outcomes if o.ok]
    if not ok:
        return None
    drafts = sum(o.drafts for o in ok)
    return 1.0 + sum(o.accepted_tokens for o in ok) / drafts if drafts else 1.0


@dataclass
class Tally:
    """Counts for the progress line and the summary; fed from one thread only."""

    outcomes: list[RequestOutcome] = field(default_factory=list)
    recent: deque[RequestOutcome] = field(default_factory=lambda: deque(maxlen=ROLLING_WINDOW))

    def add(self, outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)
        self.recent.append(outcome)

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        versions = sorted({o.drafter_version or "none" for o in self.outcomes if o.ok})
        by_version = {}
        for v in versions:
            mine = [o for o in self.outcomes if o.ok and (o.drafter_version or "none") == v]
            by_version[v] = {"requests": len(mine), "tau": _round(pooled_tau(mine))}
        return {"requests": len(self.outcomes), "failures": self.failures,
                "completion_tokens": sum(o.completion_tokens for o in self.outcomes),
                "tau": _round(pooled_tau(self.outcomes)), "by_drafter_version": by_version}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ------------------------------------------------------------------------------------------- engine


def _error_message(r: "httpx.Response") -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def model_card(client: "httpx.Client") -> dict[str, Any]:
    """The served model's card from `GET /v1/models`."""
    r = client.get("/v1/models")
    if r.status_code == 401:
        raise typer.BadParameter(f"the engine refused the key: {_error_message(r)}", param_hint="'--api-key'")
    if r.status_code != 200:
        raise ReplayFailed(f"GET {client.base_url}/v1/models answered {r.status_code}: {_error_message(r)}")
    return r.json()["data"][0]


def wait_for_engine(client: "httpx.Client", dead_after_s: float) -> dict[str, Any]:
    """The model card, retried while the engine is unreachable (it may still be starting) for up to
    `dead_after_s`."""
    import httpx

    deadline = time.monotonic() + dead_after_s
    while True:
        try:
            return model_card(client)
        except httpx.TransportError as e:
            if time.monotonic() >= deadline:
                raise ReplayFailed(f"the engine at {client.base_url} has been unreachable for "
                                   f"{dead_after_s:g} s ({type(e).__name__}: {e})") from e
        time.sleep(min(UNREACHABLE_PAUSE_S, max(0.0, deadline - time.monotonic())))


class DrafterWatch:
    """The drafter version the engine gives new requests, polled from `GET /v1/models` on a thread.

    The response does not say which drafter served it. The engine gives each sequence the drafter
    serving when it is admitted and keeps it to the end, so a request is stamped with the version
    known when it is sent; for up to one poll interval after a swap, or when a request queues across
    a swap, that stamp names the previous drafter.
    """

    def __init__(self, client: "httpx.Client", version: str | None, every_s: float = VERSION_POLL_S) -> None:
        self.version = version
        self._client = client
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drafter-watch", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import httpx

        while not self._stop.wait(self._every_s):
            try:
                r = self._client.get("/v1/models")
            except httpx.TransportError:
                continue  # the request loop counts an unreachable engine; the last known version stands
            if r.status_code == 200:
                self.version = r.json()["data"][0].get("drafter_version")


def grant_consents(client: "httpx.Client", admin_token: str, tenant: str, users: Sequence[str]) -> int:
    """Consent for every user, granted through the admin API unless this command's earlier grant is
    still in force; returns how many were granted now.

    The API never refuses a duplicate (each grant adds a record and the newest in force counts), so
    the check here only keeps repeated demo runs from piling up records and audit lines.
    """
    headers = {"Authorization": f"Bearer {admin_token}"}
    granted = 0
    for user in users:
        held = _admin(client, "/admin/consents/query", {"tenant": tenant, "user": user}, headers)["data"]
        if any(r["source"] == CONSENT_SOURCE and r["revoked_at"] is None and r["expires_at"] is None for r in held):
            continue
        _admin(client, "/admin/consents", {"tenant": tenant, "user": user, "source": CONSENT_SOURCE}, headers)
        granted += 1
    return granted


def _admin(client: "httpx.Client", path: str, body: dict[str, str], headers: dict[str, str]) -> dict[str, Any]:
    r = client.post(path, json=body, headers=headers)
    if r.status_code in (401, 403):
        raise typer.BadParameter(f"the engine refused the admin token: {_error_message(r)}",
                                 param_hint="'--admin-token' / SPECLOOP_ADMIN_TOKEN")
    if r.status_code == 404:
        raise ReplayFailed(f"the engine at {client.base_url} serves no consent admin API; it mounts one only "
                           "with trace capture on (`specloop serve --kafka-bootstrap ...`)")
    if r.status_code == 400 and r.json()["error"]["param"] == "tenant":
        raise typer.BadParameter(_error_message(r), param_hint="'--tenant'")
    if r.status_code not in (200, 201):
        raise ReplayFailed(f"the consent admin API answered {r.status_code} to {path}: {_error_message(r)}")
    return r.json()


def send(client: "httpx.Client", model: str, max_tokens: int, job: Job, version: str | None) -> RequestOutcome:
    """One greedy chat request; every failure becomes an RequestOutcome, never an exception."""
    import httpx

    body = {"model": model, "messages": list(job.prompt.messages), "max_tokens": max_tokens, "temperature": 0,
            "user": job.user}
    started = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json=body)
    except httpx.TransportError as e:
        failed = _outcome(job, started, None, version, error=f"{type(e).__name__}: {e}")
        time.sleep(UNREACHABLE_PAUSE_S)
        return failed
    if r.status_code != 200:
        return _outcome(job, started, r.status_code, version, error=_error_message(r))
    usage = r.json()["usage"]
    spec = usage.get("speculation") or {}  # absent when nothing was drafted: τ is then 1
    return _outcome(job, started, 200, version, completion_tokens=usage["completion_tokens"],
                    drafts=spec.get("drafts", 0), accepted_tokens=spec.get("accepted_tokens", 0),
                    tau=spec.get("mean_accepted_length", 1.0))


def _outcome(job: Job, started: float, status: int | None, version: str | None, **fields: Any) -> RequestOutcome:
    return RequestOutcome(at=datetime.now(UTC).isoformat(), task=job.prompt.task, user=job.user,
                   latency_s=round(time.monotonic() - started, 4), status=status, drafter_version=version,
                   **fields)


# --------------------------------------------------------------------------------------------- loop


def job_stream(prompts: Sequence[Prompt], users: Sequence[str], repeat: bool, limit: int | None) -> Iterator[Job]:
    """The prompts in order (cycled with `repeat`), request i sent as user i mod len(users)."""
    stream = itertools.cycle(prompts) if repeat else iter(prompts)
    for i, prompt in enumerate(itertools.islice(stream, limit)):
        yield Job(prompt, users[i % len(users)])


@dataclass
class Liveness:
    """When the engine stopped answering at all (any HTTP response, even an error, counts as alive)."""

    dead_after_s: float
    unreachable_since: float | None = None
    last_error: str | None = None

    def saw(self, outcome: RequestOutcome) -> None:
        if outcome.status is not None:
            self.unreachable_since = None
        elif self.unreachable_since is None:
            # From this failure's end, not its start: a read timeout means 300 s of a slow engine, not
            # 300 s of a dead one.
            self.unreachable_since = time.monotonic()
            self.last_error = outcome.error

    def dead(self) -> bool:
        return self.unreachable_since is not None and time.monotonic() - self.unreachable_since > self.dead_after_s


def drive(work: Iterator[Job], submit: Callable[[Job], Future], concurrency: int, deadline: float | None,
          on_done: Callable[[RequestOutcome], None], liveness: Liveness, tick: Callable[[], None],
          paused: Callable[[], bool] = lambda: False) -> None:
    """Keep `concurrency` requests in flight until the jobs run out, `deadline` (monotonic) passes or
    the engine is dead; the ones in flight then finish. While `paused()`, nothing new is sent. A
    first Ctrl-C stops sending the same way, so the summary still comes; a second one raises."""
    pending: set[Future] = set()
    interrupted = False
    exhausted = False
    while True:
        stopping = interrupted or liveness.dead() or (deadline is not None and time.monotonic() >= deadline)
        while not stopping and not paused() and len(pending) < concurrency:
            job = next(work, None)
            if job is None:
                exhausted = True
                break
            pending.add(submit(job))
        if not pending and (stopping or exhausted):
            return
        if not pending:  # paused with nothing in flight
            time.sleep(PAUSE_POLL_S)
            tick()
            continue
        try:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
        except KeyboardInterrupt:
            if interrupted:
                raise
            log.warning("Ctrl-C: sending stopped; waiting for the %d requests in flight", len(pending))
            interrupted = True
            continue
        for f in done:
            outcome = f.result()
            liveness.saw(outcome)
            on_done(outcome)
        tick()


class Recorder:
    """Appends each outcome as a JSONL line, flushed at once so a stopped run keeps what it finished."""

    def __init__(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None if path is None else path.open("a")

    def __call__(self, outcome: RequestOutcome) -> None:
        if self._file is not None:
            self._file.write(json.dumps(asdict(outcome)) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ------------------------------------------------------------------------------------------ command


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


def replay(
    api_key: Annotated[str, typer.Option(help="A key of --tenant (the tenants file's api_keys)")],
    tenant: Annotated[str, typer.Option(help="The tenant the key belongs to; it must allow capture")],
    admin_token: Annotated[str | None, typer.Option(envvar="SPECLOOP_ADMIN_TOKEN",
                                                    help="The engine's consent admin token")] = None,
    url: Annotated[str, typer.Option(help="The engine's base URL")] = "http://127.0.0.1:8000",
    source: Annotated[PromptSource, typer.Option(help="Prompt set")] = "humaneval",
    prompts_file: Annotated[Path | None, typer.Option(help='source=file: JSONL of {"messages": [...]}')] = None,
    per_task: Annotated[int, typer.Option(min=1, help="evals only: prompts sampled from each task")] = 20,
    seed: Annotated[int, typer.Option(help="evals only: prompt sampling seed")] = 0,
    users: Annotated[int, typer.Option(min=1, help="Demo users user-0 .. user-N-1, each granted consent")] = 8,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Completion tokens per request")] = 192,
    limit: Annotated[int | None, typer.Option(min=1, help="Send at most this many requests")] = None,
    repeat: Annotated[bool, typer.Option(help="Cycle through the prompts until --limit or --duration-s "
                                              "(or Ctrl-C); otherwise send each once")] = False,
    heldout_fraction: Annotated[float, typer.Option(help="Share of prompts held out, never sent: [0, 1)")] = 0.25,
    record: Annotated[Path | None, typer.Option(help="JSONL file to append one line per finished request to")] = None,
    duration_s: Annotated[float | None, typer.Option(help="Stop sending after this many seconds")] = None,
    dead_after_s: Annotated[float, typer.Option(help="Exit 1 once the engine is unreachable this long (s)")] = 30.0,
    pause_while_training: Annotated[str | None, typer.Option(
        help="A retraining daemon's base URL: send nothing while it runs (its /health run_in_progress)")] = None,
) -> None:
    """Send consented chat traffic from a prompt set to a running engine, so its traces can train the drafter."""
    if admin_token is None:
        raise typer.BadParameter("needed to grant the demo users consent", param_hint="'--admin-token'")
    if not 0 <= heldout_fraction < 1:
        raise typer.BadParameter(f"must be in [0, 1), got {heldout_fraction}", param_hint="'--heldout-fraction'")
    for name, seconds in (("--duration-s", duration_s), ("--dead-after-s", dead_after_s)):
        if seconds is not None and seconds <= 0:
            raise typer.BadParameter(f"must be > 0, got {seconds}", param_hint=f"'{name}'")
    traffic, heldout = traffic_split(_prompts(source, prompts_file, per_task, seed), heldout_fraction)
    if not traffic:
        raise typer.BadParameter(f"holds out all {len(heldout)} prompts", param_hint="'--heldout-fraction'")
    log.info("%d prompts to send, %d held out", len(traffic), len(heldout))
    plan = ReplayPlan(url, api_key, admin_token, tenant, tuple(f"user-{i}" for i in range(users)), concurrency,
                      max_tokens, limit, repeat, record, duration_s, dead_after_s, pause_while_training)
    try:
        tally, liveness = _run(plan, traffic)
    except ReplayFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(json.dumps({"traffic_prompts": len(traffic), "heldout_prompts": len(heldout), **tally.summary()}))
    if liveness.dead():
        typer.echo(f"error: the engine at {url} has been unreachable for more than {dead_after_s:g} s "
                   f"({liveness.last_error}); stopped", err=True)
        raise typer.Exit(1)


@dataclass(frozen=True)
class ReplayPlan:
    """The command's options, checked."""

    url: str
    api_key: str
    admin_token: str
    tenant: str
    users: tuple[str, ...]
    concurrency: int
    max_tokens: int
    limit: int | None
    repeat: bool
    record: Path | None
    duration_s: float | None
    dead_after_s: float
    pause_while_training: str | None = None

    def planned(self, prompts: int) -> int | None:
        """Requests the plan will send, when known in advance."""
        return self.limit if self.repeat else min(prompts, self.limit or prompts)


def _prompts(source: PromptSource, prompts_file: Path | None, per_task: int, seed: int) -> list[Prompt]:
    from specloop.daemon.training.prompts import prompt_set

    try:
        return prompt_set(source, prompts_file, per_task, seed)
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("prompts_file: "), param_hint="'--prompts-file'") from e


def _run(plan: ReplayPlan, traffic: list[Prompt]) -> tuple[Tally, Liveness]:
    """Consent, then the traffic."""
    import httpx

    timeout = httpx.Timeout(300.0, connect=10.0)  # a long greedy answer on a CPU takes minutes
    limits = httpx.Limits(max_connections=plan.concurrency + 2)  # the requests, the version poll, one spare
    headers = {"Authorization": f"Bearer {plan.api_key}"}
    with httpx.Client(base_url=plan.url, headers=headers, timeout=timeout, limits=limits) as client:
        card = wait_for_engine(client, plan.dead_after_s)
        granted = grant_consents(client, plan.admin_token, plan.tenant, plan.users)
        log.info("consent: %d of %d demo users granted now, the rest held it already", granted, len(plan.users))
        with DrafterWatch(client, card.get("drafter_version")) as watch:
            return _send_all(client, card["id"], watch, plan, traffic)


def _send_all(client: "httpx.Client", model: str, watch: DrafterWatch, plan: ReplayPlan,
              traffic: list[Prompt]) -> tuple[Tally, Liveness]:
    tally, liveness, recorder = Tally(), Liveness(plan.dead_after_s), Recorder(plan.record)
    deadline = None if plan.duration_s is None else time.monotonic() + plan.duration_s
    with ThreadPoolExecutor(plan.concurrency, thread_name_prefix="replay") as pool, _progress() as progress:
        task = progress.add_task("replay", total=plan.planned(len(traffic)), failures=0, tau="-",
                                 drafter=watch.version or "none")

        def submit(job: Job) -> Future:
            return pool.submit(send, client, model, plan.max_tokens, job, watch.version)

        def done(outcome: RequestOutcome) -> None:
            tally.add(outcome)
            recorder(outcome)
            progress.advance(task)

        def tick() -> None:
            tau = pooled_tau(tally.recent)
            progress.update(task, failures=tally.failures, tau="-" if tau is None else f"{tau:.2f}",
                            drafter=watch.version or "none")

        try:
            with TrainingWatch(plan.pause_while_training) as training:
                drive(job_stream(traffic, plan.users, plan.repeat, plan.limit), submit, plan.concurrency, deadline,
                      done, liveness, tick, training.in_progress)
        finally:
            recorder.close()
    return tally, liveness


class TrainingWatch:
    """Whether a retraining daemon is in a run, polled from its /health in a thread.

    On a machine that also trains (the 2-core demo), traffic and training would each run at about
    half speed; a deployment trains elsewhere. An unreachable daemon counts as not training.
    """

    def __init__(self, daemon_url: str | None) -> None:
        self.url = None if daemon_url is None else daemon_url.rstrip("/")
        self.training = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training-watch", daemon=True)

    def __enter__(self) -> Self:
        if self.url is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def in_progress(self) -> bool:
        return self.training

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            try:
                was, self.training = self.training, bool(httpx.get(f"{self.url}/health", timeout=5).json()
                                                         .get("run_in_progress"))
            except (httpx.HTTPError, ValueError):
                was, self.training = self.training, False
            if self.training != was:
                log.info("%s: the daemon is %s", "pausing" if self.training else "resuming",
                         "training" if self.training else "done training")
            self._stop.wait(PAUSE_POLL_S)


def _progress() -> "Progress":
    """One line on stderr: requests done, failures, τ of the last 20, the drafter serving."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("failures {task.fields[failures]}"),
                    TextColumn(f"τ(last {ROLLING_WINDOW}) {{task.fields[tau]}}"),
                    TextColumn("drafter {task.fields[drafter]}"), TimeElapsedColumn(),
                    console=Console(stderr=True))
