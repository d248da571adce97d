"""What a fleet's faults cost its clients, on the real SmolLM2: `specloop fleet` (one Postgres, MLflow
with its basic-auth app, two engines, two sinks, two daemons; daemon/fleet/) broken one part at a
time while clients stream to the engines, side by side in one run.

Clients: `--clients` threads stream anonymous chat completions (never captured, so they start no
run) to the engines in turn, as a load balancer would send them; while an engine is down they send
only to the other. Consented requests (the demo's formal-logic prompts, `--batch` at a time) are the
traces the daemons train on. The faults, in order:

1. SIGKILL the daemon that holds the training lease, in training: seconds until the other daemon
   holds it; seconds from the promotion its run makes to both engines serving that version (the
   daemon tells them at once; their poll, every 30 s, is the backstop).
2. SIGKILL one engine: requests failed on the other; seconds until the restarted engine serves the
   champion after it is ready.
3. SIGKILL one sink while consented traffic flows: traces lost and duplicated in Parquet, by trace
   id against what clients were answered; seconds until every trace is stored.
4. Restart Postgres: requests failed; seconds until both daemons have ticked again.
5. Stop MLflow for `--mlflow-down-s`: requests failed, whether each engine kept its drafter, how a
   run in flight ended; then seconds until the next promotion.

The policy trains for `--train-minutes`, promotes any challenger (`gate.min_relative_gain: -1`) and
all but never rolls back (`rollout.rollback_below: 0.01`; the clients' one repeated prompt gives
suffix decoding a τ near 10, and a first run rolled v2 back on it): this measures what the topology
does with a promotion, not whether one is earned.

Writes `benchmarks/results/fleet_faults.json`. Run: `.venv/bin/python benchmarks/fleet_faults.py`
(about 15 minutes on 2 cores). This is not a test.
"""

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import httpx
from sqlalchemy import text

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from specloop.daemon.fleet.topology import Fleet, FleetConfig, wait_until  # noqa: E402
from specloop.daemon.retrain.history import Action, PromotionHistory  # noqa: E402
from specloop.daemon.retrain.run_log import RunLog, RunOutcome  # noqa: E402
from specloop.daemon.retrain.state_db import open_state  # noqa: E402
from specloop.daemon.stack import DEMO_TENANT  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fleet_faults.json"
POLICY = """
schedule: {{interval_minutes: 0.1}}
triggers: {{min_new_traces: 24, first_drafter: false}}
data: {{min_traces: 24, first_drafter_prompts: 0}}
training: {{max_steps: 100000, max_minutes: {minutes}}}
evaluation: {{heldout_fraction: 0.25, min_heldout: 6}}
gate: {{min_relative_gain: -1.0}}
rollout: {{rollback_below: 0.01}}
cooldown_minutes: 0
"""
USERS = [f"bench-user-{i}" for i in range(8)]
POLL_S = 30.0  # the engines' default: a promotion reaches them sooner, by the daemon's notice


class Clients:
    """Anonymous streaming clients over `targets()` (re-read per request); answers and failures."""

    def __init__(self, targets, count: int, model: str) -> None:
        self.targets, self.model = targets, model
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> "Clients":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def counts(self) -> tuple[int, int]:
        return self.ok, len(self.failed)

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            urls = self.targets()
            url = urls[i % len(urls)]
            i += 1
            body = {"model": self.model, "messages": [{"role": "user", "content": "Name three birds."}],
                    "max_tokens": 48, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                if r.status_code == 200 and lines and lines[-1] == "data: [DONE]":
                    self.ok += 1
                else:
                    self.failed.append(f"{url}: {r.status_code}")
            except httpx.HTTPError as e:
                self.failed.append(f"{url}: {type(e).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=48, help="consented requests per batch")
    parser.add_argument("--train-minutes", type=float, default=1.0)
    parser.add_argument("--mlflow-down-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--logs", type=Path, help="keep the fleet's logs here (its temporary directory goes)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fleet-faults-") as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(POLICY.format(minutes=args.train_minutes))
        config = FleetConfig(Path(tmp) / "fleet", policy=policy, engine_port=0, daemon_port=0, mlflow_port=0,
                             registry_poll_s=POLL_S, sink_flush_s=2.0)
        started = time.monotonic()
        with Fleet(config) as fleet:
            report = {"machine": describe(), "clients": args.clients, "registry_poll_s": POLL_S,
                      "train_minutes": args.train_minutes, "up_s": round(time.monotonic() - started, 1)}
            try:
                report["faults"] = run_faults(fleet, args)
            finally:
                if args.logs is not None:
                    shutil.copytree(fleet.root / "logs", args.logs, dirs_exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["faults"], indent=2))


def run_faults(fleet: Fleet, args: argparse.Namespace) -> dict[str, dict]:
    card = httpx.get(f"{fleet.engine_urls[0]}/v1/models", timeout=10).json()["data"][0]
    model, base = card["id"], card["fingerprint"]
    grant_consents(fleet)
    prompts = [p.messages for p in prompt_set("formal-logic")]
    consented = Consented(fleet, model, prompts)
    live = list(fleet.engine_urls)
    clients = Clients(lambda: live, args.clients, model).start()
    faults: dict[str, dict] = {}
    try:
        faults["daemon_sigkill"] = daemon_fault(fleet, base, consented, args.batch)
        faults["engine_sigkill"] = engine_fault(fleet, clients, live)
        faults["sink_sigkill"] = sink_fault(fleet, consented, args.batch)
        faults["postgres_restart"] = postgres_fault(fleet, clients)
        faults["mlflow_down"] = mlflow_fault(fleet, base, clients, consented, args.batch, args.mlflow_down_s)
    finally:
        clients.stop()
    faults["all"] = {"requests_ok": clients.ok, "requests_failed": len(clients.failed),
                     "failures": clients.failed[:20]}
    return faults


class Consented:
    """Consented chat requests (captured); the trace ids answered."""

    def __init__(self, fleet: Fleet, model: str, prompts: list) -> None:
        self.fleet, self.model, self.prompts = fleet, model, prompts
        self.sent: list[str] = []
        self._i = 0

    def send_meanwhile(self, count: int) -> threading.Thread:
        """`send(count)` on a thread, so that a run can be caught in training while the traces arrive."""
        sender = threading.Thread(target=self.send, args=(count,), daemon=True)
        sender.start()
        return sender

    def send(self, count: int, urls: list[str] | None = None) -> list[str]:
        urls = urls or self.fleet.engine_urls
        ids = []
        for _ in range(count):
            body = {"model": self.model, "messages": self.prompts[self._i % len(self.prompts)], "max_tokens": 96,
                    "temperature": 0, "user": USERS[self._i % len(USERS)]}
            r = httpx.post(f"{urls[self._i % len(urls)]}/v1/chat/completions", json=body, timeout=300,
                           headers={"Authorization": f"Bearer {self.fleet.api_key}"})
            r.raise_for_status()
            ids.append(r.json()["id"])
            self._i += 1
        self.sent += ids
        return ids


def grant_consents(fleet: Fleet) -> None:
    for user in USERS:
        httpx.post(f"{fleet.engine_urls[0]}/admin/consents", timeout=30, json={"tenant": DEMO_TENANT, "user": user,
                   "source": "benchmark"}, headers={"Authorization": f"Bearer {fleet.admin_token}"}).raise_for_status()


def state(fleet: Fleet):
    return open_state(fleet.postgres.url("specloop_state"))


def lease_holder(fleet: Fleet) -> str | None:
    with state(fleet).connect() as conn:
        row = conn.execute(text("SELECT owner FROM leases WHERE name LIKE 'train:%' AND expires_at > :now"),
                           {"now": time.time()}).first()
    return None if row is None else row.owner


def served(url: str) -> str | None:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["drafter_version"]


def new_training_run(runs: RunLog, before: set[str]):
    return next((r for r in runs.runs() if r.run_id not in before and r.step == "train"
                 and r.outcome is RunOutcome.RUNNING), None)


def both_serve_next_promotion(fleet: Fleet, history: PromotionHistory, base: str, after) -> dict[str, float | str]:
    """Waits for a promotion newer than `after`; seconds from the newest promotion to both engines
    serving it (traffic goes on, so a later promotion may supersede the first)."""
    wait_until(lambda: (e := history.last(base, Action.PROMOTED)) is not None and e != after, 900, "a promotion")

    def settled():
        event = history.last(base, Action.PROMOTED)
        return event if all(served(u) == event.version for u in fleet.engine_urls) else None

    event = wait_until(settled, 600, "both engines serving the newest promotion", poll_s=0.2)
    return {"version": event.version, "both_engines_serve_s": round(time.time() - event.at.timestamp(), 2)}


def daemon_fault(fleet: Fleet, base: str, consented: Consented, batch: int) -> dict:
    runs, history = RunLog(state(fleet)), PromotionHistory(state(fleet))
    before = {r.run_id for r in runs.runs()}
    last = history.last(base, Action.PROMOTED)
    sender = consented.send_meanwhile(batch)
    training = wait_until(lambda: new_training_run(runs, before), 900, "a run in training")
    holder = lease_holder(fleet)
    pid = int(holder.split(":")[1])
    (name,) = [n for n, s in fleet.services.items() if s.kind == "daemon" and s.process.pid == pid]
    fleet.kill(name, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: (h := lease_holder(fleet)) is not None and h != holder, 300, "the lease taken over")
    takeover_s = time.monotonic() - killed
    result = both_serve_next_promotion(fleet, history, base, last)
    killed_run = next(r for r in runs.runs() if r.run_id == training.run_id)
    fleet.start(name)
    sender.join()
    return {"killed": name, "lease_takeover_s": round(takeover_s, 2), "killed_run": killed_run.outcome.value,
            **result}


def engine_fault(fleet: Fleet, clients: Clients, live: list[str]) -> dict:
    survivor, victim = fleet.engine_urls
    live.remove(victim)
    ok, failed = clients.counts()
    fleet.kill("engine-2")
    time.sleep(10)
    during = clients.counts()
    started = time.monotonic()
    fleet.start("engine-2")
    ready_s = time.monotonic() - started
    ready = time.monotonic()
    wait_until(lambda: served(victim) == served(survivor), 300, "the restarted engine serving the champion")
    live.append(victim)
    return {"requests_ok_on_survivor": during[0] - ok, "requests_failed": during[1] - failed,
            "restart_ready_s": round(ready_s, 1), "champion_after_ready_s": round(time.monotonic() - ready, 2)}


def stored_ids(fleet: Fleet) -> list[str]:
    files = [str(f) for f in fleet.traces_root.rglob("*.parquet")]
    return [] if not files else [r[0] for r in duckdb.sql(f"SELECT trace_id FROM read_parquet({files!r})").fetchall()]


def sink_fault(fleet: Fleet, consented: Consented, batch: int) -> dict:
    sent = consented.send(batch // 2)
    fleet.kill("sink-1", signal.SIGKILL)
    killed = time.monotonic()
    sent += consented.send(batch // 2)
    wait_until(lambda: set(consented.sent) <= set(stored_ids(fleet)), 300, "every trace stored")
    all_stored_s = time.monotonic() - killed
    fleet.start("sink-1")
    stored = stored_ids(fleet)
    return {"traces_sent": len(consented.sent), "traces_lost": len(set(consented.sent) - set(stored)),
            "traces_duplicated": len(stored) - len(set(stored)), "all_stored_after_kill_s": round(all_stored_s, 1)}


def ticks(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("specloop_daemon_ticks_total"))


def postgres_fault(fleet: Fleet, clients: Clients) -> dict:
    ok, failed = clients.counts()
    before = [ticks(u) for u in fleet.daemon_urls]
    started = time.monotonic()
    fleet.postgres.restart()
    restart_s = time.monotonic() - started
    wait_until(lambda: all(ticks(u) > b for u, b in zip(fleet.daemon_urls, before)), 300, "both daemons ticking")
    after = clients.counts()
    return {"restart_s": round(restart_s, 2), "both_daemons_ticked_s": round(time.monotonic() - started, 1),
            "requests_ok": after[0] - ok, "requests_failed": after[1] - failed,
            "processes_running": all(s.running for s in fleet.services.values())}


def mlflow_fault(fleet: Fleet, base: str, clients: Clients, consented: Consented, batch: int, down_s: float
                 ) -> dict:
    runs, history = RunLog(state(fleet)), PromotionHistory(state(fleet))
    before = {r.run_id for r in runs.runs()}
    last = history.last(base, Action.PROMOTED)
    sender = consented.send_meanwhile(batch)
    training = wait_until(lambda: new_training_run(runs, before), 900, "a run in training")
    ok, failed = clients.counts()
    fleet.stop("mlflow")
    serving = [served(u) for u in fleet.engine_urls]
    time.sleep(down_s)
    kept = [served(u) for u in fleet.engine_urls] == serving
    during = clients.counts()
    fleet.start("mlflow")
    back = time.monotonic()
    in_flight = wait_until(lambda: next((r for r in runs.runs() if r.run_id == training.run_id
                                         and r.outcome is not RunOutcome.RUNNING), None), 600, "the run ended")
    sender.join()
    sender = consented.send_meanwhile(batch)  # watched from the start: sending takes as long as a run
    result = both_serve_next_promotion(fleet, history, base, last)
    sender.join()
    return {"down_s": down_s, "requests_ok": during[0] - ok, "requests_failed": during[1] - failed,
            "engines_kept_their_drafter": kept, "run_in_flight": in_flight.outcome.value,
            "run_in_flight_detail": in_flight.detail[:200], "next_promotion_after_back_s":
            round(time.monotonic() - back, 1), **result}


if __name__ == "__main__":
    main()
