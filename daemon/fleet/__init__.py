"""The production topology on one machine (`specloop fleet`, `make fleet`): a shared Postgres, an
MLflow server, several engines, sinks and daemons as processes, for running and for breaking.

- `postgres.py`: the one Postgres server (the `pgserver` wheel) and its two databases;
- `topology.py`: `Fleet`, every process by name, started, killed and restarted;
- `cli.py`: the `specloop fleet` command.
"""
