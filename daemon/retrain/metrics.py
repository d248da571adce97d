"""The daemon's Prometheus metrics, on a registry of its own: runs by outcome, step durations, the
last τ of champion and challenger from the gate, gate decisions, alias moves, and the schedule.

This file only declares and updates metrics; the service serves them at /metrics.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; a run's steps take from under a second (dataset) to the training budget (minutes to hours).
_STEP_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 2400, 3600, 7200)


class DaemonMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.runs = Counter("specloop_daemon_runs", "Retraining runs by outcome.", ["outcome"], registry=r)
        self.ticks = Counter("specloop_daemon_ticks", "Scheduled ticks by what they did.", ["decision"], registry=r)
        self.step_seconds = Histogram("specloop_daemon_step_seconds", "Duration of each step of a run.", ["step"],
                                      buckets=_STEP_BUCKETS, registry=r)
        self.tau = Gauge("specloop_daemon_gate_tau", "Replayed τ of the last contest, by contender.",
                         ["contender"], registry=r)
        self.gate = Counter("specloop_daemon_gate_decisions", "Gate decisions by verdict.", ["verdict"], registry=r)
        self.alias_moves = Counter("specloop_daemon_alias_moves", "Promotions, rollbacks, approvals and refusals.",
                                   ["action"], registry=r)
        self.next_run = Gauge("specloop_daemon_next_tick_timestamp_seconds", "When the next scheduled tick is due.",
                              registry=r)
        self.engine_notices = Counter("specloop_daemon_engine_notices",
                                      "Engines told of a moved or benched champion, by result (engine_notice.py).",
                                      ["result"], registry=r)
        self.running = Gauge("specloop_daemon_run_in_progress", "1 while a run is in progress.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
