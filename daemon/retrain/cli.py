"""The retraining loop's commands: `specloop daemon`, `specloop policy validate`, `specloop status`
and `specloop approve`.

Each validates its options (a policy error names field and line), builds what it needs and calls
one thing: the daemon under uvicorn, `load_policy`, `status`, or the approval tag. Heavy imports
(torch, MLflow, the daemon) happen inside the commands, so `specloop --help` stays fast.
"""

import getpass
import json
from pathlib import Path
from typing import Annotated, Any

import typer

policy_app = typer.Typer(no_args_is_help=True, help="Retrain policies.")

_REGISTRY = typer.Option(envvar="SPECLOOP_REGISTRY", help="MLflow tracking URI (sqlite:///... or http://...)")
_STATE_DB = typer.Option(envvar="SPECLOOP_DAEMON_STATE_DB", help="The daemon's state database URL")


def register(app: typer.Typer) -> None:
    app.command("daemon")(daemon)
    app.command("status")(status_command)
    app.command("approve")(approve)
    app.add_typer(policy_app, name="policy")


@policy_app.command("validate")
def validate(files: Annotated[list[Path], typer.Argument(help="Policy YAML files")]) -> None:
    """Check retrain policy files; each error names the field and its line."""
    from specloop.daemon.retrain.policy import PolicyError, load_policy

    failed = False
    for file in files:
        try:
            load_policy(file)
        except PolicyError as e:
            typer.echo(str(e), err=True)
            failed = True
        else:
            typer.echo(f"{file}: ok")
    if failed:
        raise typer.Exit(1)


def daemon(
    policy: Annotated[Path | None, typer.Option(help="Retrain policy YAML [env SPECLOOP_DAEMON_POLICY]")] = None,
    registry: Annotated[str | None, typer.Option(help="MLflow tracking URI [env SPECLOOP_REGISTRY]")] = None,
    traces_root: Annotated[Path | None, typer.Option(help="The sink's Parquet root [env SPECLOOP_TRACES_ROOT]")]
    = None,
    consent_db: Annotated[Path | None, typer.Option(help="Consent registry file [env SPECLOOP_CONSENT_DB]")] = None,
    state_db: Annotated[str | None, typer.Option(help="State database URL [env SPECLOOP_DAEMON_STATE_DB]")] = None,
    engine: Annotated[list[str] | None, typer.Option(
        help="Engine base URL whose /metrics give live τ; repeatable [env SPECLOOP_DAEMON_ENGINES, comma-separated]")]
    = None,
    model: Annotated[str | None, typer.Option(help="Target model, as the engines serve it [env SPECLOOP_MODEL]")]
    = None,
    weights: Annotated[str | None, typer.Option(
        help="auto (default), dense, gguf or nvfp4, as the engines serve the target [env SPECLOOP_WEIGHTS]")] = None,
    nvfp4_lm_head: Annotated[bool | None, typer.Option(
        "--nvfp4-lm-head/--no-nvfp4-lm-head", help="As the engines serve it [env SPECLOOP_NVFP4_LM_HEAD]")] = None,
    nvfp4_embedding: Annotated[bool | None, typer.Option(
        "--nvfp4-embedding/--no-nvfp4-embedding", help="As the engines serve it [env SPECLOOP_NVFP4_EMBEDDING]")]
    = None,
    work_dir: Annotated[Path | None, typer.Option(help="Runs' datasets and challengers")] = None,
    host: Annotated[str | None, typer.Option(help="Interface for /health and /metrics (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port for /health and /metrics (default 8100)")] = None,
    plot: Annotated[Path | None, typer.Option(help="Redraw a PNG of live τ per drafter version here every minute")]
    = None,
) -> None:
    """Run the retraining daemon for the target's base model until SIGTERM."""
    settings, retrain_policy = _daemon_settings({
        "policy": policy, "registry": registry, "traces_root": traces_root, "consent_db": consent_db,
        "state_db": state_db, "engines": engine, "model": model, "weights": weights, "nvfp4_lm_head": nvfp4_lm_head,
        "nvfp4_embedding": nvfp4_embedding, "work_dir": work_dir, "host": host, "port": port, "plot": plot})
    run_daemon(settings, retrain_policy)


def run_daemon(settings: Any, policy: Any) -> None:
    """Load the target, then serve the daemon's HTTP side with the daemon in its lifespan."""
    import torch
    import uvicorn

    from specloop.daemon.retrain.challenger import training_dtype
    from specloop.daemon.retrain.http import daemon_app
    from specloop.daemon.retrain.service import RetrainDaemon
    from specloop.engine.loaders.load import load_for_inference, resolve_device

    target = load_for_inference(settings.model, getattr(torch, training_dtype(policy.training.dtype)),
                                resolve_device(None), settings.weight_format())
    uvicorn.run(daemon_app(RetrainDaemon(settings, policy, target)), host=settings.host, port=settings.port,
                log_config=None)


def _daemon_settings(options: dict[str, Any]) -> tuple[Any, Any]:
    from pydantic import ValidationError

    from specloop.daemon.retrain.policy import PolicyError, load_policy
    from specloop.daemon.retrain.settings import DaemonSettings

    try:
        settings = DaemonSettings(**{k: v for k, v in options.items() if v not in (None, [])})
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "?"
        raise typer.BadParameter(f"{first['msg']} (set --{name.replace('_', '-')} or its environment variable)",
                                 param_hint=f"--{name.replace('_', '-')}") from None
    try:
        policy = load_policy(settings.policy)
    except PolicyError as e:
        raise typer.BadParameter(str(e), param_hint="--policy") from None
    return settings, policy


def status_command(
    registry: Annotated[str | None, _REGISTRY] = None,
    state_db: Annotated[str, _STATE_DB] = "sqlite:///data/daemon/state.db",
    base_model: Annotated[str | None, typer.Option(help="Only this base model (default: every one known)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Champion per base model, last runs, next run and pending approvals."""
    from specloop.daemon.retrain.state_db import open_state
    from specloop.daemon.retrain.status import base_models, status
    from specloop.storage.registry import DrafterRegistry

    db = open_state(state_db)
    drafters = None if registry is None else DrafterRegistry(registry)
    reports = [status(db, drafters, fp) for fp in ([base_model] if base_model else base_models(db))]
    if as_json:
        typer.echo(json.dumps(reports, indent=2))
        return
    if not reports:
        typer.echo(f"no retraining runs recorded in {state_db}")
    for report in reports:
        typer.echo(_human(report))


def _human(report: dict[str, Any]) -> str:
    lines = [f"base model {report['base_model']}"]
    for alias in ("champion", "challenger"):
        v = report.get(alias)
        if v is not None:
            approval = f", approval {v['approval']}" if v["approval"] else ""
            gain = "?" if v["speed_over_suffix"] is None else f"{v['speed_over_suffix']:+.1%}"
            benched = (f"; benched: {gain} against suffix decoding alone, which drafts alone"
                       if alias == "champion" and v["benched"] else "")
            lines.append(f"  {alias}: {v['version']} (τ {v['tau_challenger']} vs {v['tau_champion']}{approval}"
                         f"{benched})")
    if report.get("pending_approvals"):
        lines.append(f"  pending approvals: {', '.join(report['pending_approvals'])} (specloop approve VERSION)")
    lines.append(f"  next tick: {report['next_tick'] or 'not scheduled'}")
    for r in report["last_runs"]:
        lines.append(f"  run {r['run_id']}: {r['outcome']} at step {r['step']} — {r['detail']}")
    for e in report["history"]:
        lines.append(f"  {e['at']} {e['action']} {e['version']} (was {e['previous']}, by {e['actor']}): {e['reason']}")
    return "\n".join(lines)


def approve(
    version: Annotated[str, typer.Argument(help="The version to approve: 3 or v3")],
    registry: Annotated[str, _REGISTRY],
    base_model: Annotated[str | None, typer.Option(help="Default: the base model whose challenger it is")] = None,
    reject: Annotated[bool, typer.Option(help="Reject instead: it will never be promoted")] = False,
    state_db: Annotated[str, _STATE_DB] = "sqlite:///data/daemon/state.db",
    reason: Annotated[str, typer.Option(help="Recorded in the promotion history")] = "",
) -> None:
    """Approve (or reject) a challenger that waits for a person; the daemon promotes it at its next watch."""
    from specloop.daemon.retrain.history import Action, PromotionHistory
    from specloop.daemon.retrain.state_db import open_state
    from specloop.daemon.retrain.status import base_models
    from specloop.storage.registry import CHALLENGER, Approval, DrafterRegistry, Tag

    number = version.removeprefix("v")
    if not number.isdigit():
        raise typer.BadParameter(f"a version number like 3 or v3, got {version!r}", param_hint="VERSION")
    drafters, db = DrafterRegistry(registry), open_state(state_db)
    candidates = [base_model] if base_model else base_models(db)
    waiting = [fp for fp in candidates if (c := drafters.by_alias(fp, CHALLENGER)) is not None and c.version == number]
    if len(waiting) != 1:
        where = f"base model {base_model}" if base_model else "any base model the state database knows"
        raise typer.BadParameter(f"v{number} is not the challenger of {where}" if not waiting else
                                 f"v{number} is the challenger of several base models; give --base-model",
                                 param_hint="VERSION")
    fp = waiting[0]
    answer = Approval.REJECTED if reject else Approval.APPROVED
    drafters.set_tags(fp, number, {Tag.APPROVAL: answer.value})
    actor = getpass.getuser()
    PromotionHistory(db).record(fp, Action.REJECTED if reject else Action.APPROVED, f"v{number}",
                                reason or f"{answer.value} with specloop approve", actor=actor)
    typer.echo(f"v{number} of {fp}: approval={answer.value} (by {actor})")
