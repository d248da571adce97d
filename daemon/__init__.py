"""The retraining side, in subfolders lowest first (each imports only those before it): `evaluation/`
(τ by replay over stored target outputs, and live), `training/` (prompt sets, bootstrap data generation,
target features, the trainer and their commands), `traffic/` (the demo's consented client traffic) and
`retrain/` (the daemon: policy, runs, gate, promotion, rollback, scheduling) and `fleet/` (`specloop
fleet`: the production topology as processes on one machine, with its shared Postgres). Beside them:
`cli.py` (the `specloop` command line root), `stack.py` (`specloop up`), `shipped_drafters.py` with `drafters/` (the
drafter that ships for the default model), `policies/` (the retrain policies it ships) and
`child_command.py` (how a `specloop` subcommand is started as a child process).

Not here: serving (`engine/`), the trace store and dataset builder (`storage/`), consent (`consent/`).
"""
