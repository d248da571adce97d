"""`specloop consent grant|revoke|list`: consent administration from a shell.

Reads the same `SPECLOOP_*` settings as the engine (so it pseudonymizes with the same key and
writes the same registry and audit log) and calls `specloop.consent.service`; it holds no consent logic.
Errors an operator can fix exit with status 2 and name the option. `register` takes storage's trace
eraser from the caller (`daemon/cli.py`), since consent does not import storage.
"""

import getpass
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated

import typer

from specloop.consent.erasure import TraceEraser
from specloop.consent.registry import ConsentRecord, ConsentRegistry, InvalidField
from specloop.consent.service import ConsentService, record_fields
from specloop.consent.settings import ConsentSettings
from specloop.consent.tenants import TenantDirectory

consent_app = typer.Typer(no_args_is_help=True, help="Grant, revoke and list consent records.")

Tenant = Annotated[str, typer.Option(help="Tenant name, as in the tenants file.")]
User = Annotated[str | None, typer.Option(help="Raw user id (the OpenAI `user` field).")]
Subject = Annotated[str | None, typer.Option(help="Subject pseudonym, instead of --user.")]
Purpose = Annotated[str | None, typer.Option(help="Purpose; default: the tenant's.")]


def register(app: typer.Typer, erase_traces: TraceEraser) -> None:
    app.add_typer(consent_app, name="consent", context_settings={"obj": erase_traces})


@consent_app.command()
def grant(
    ctx: typer.Context,
    tenant: Tenant,
    user: User = None,
    subject: Subject = None,
    purpose: Purpose = None,
    policy_version: Annotated[str | None, typer.Option(help="Default: the tenant's.")] = None,
    expires_at: Annotated[str | None, typer.Option(help="ISO 8601 with offset.")] = None,
    source: Annotated[str, typer.Option(help="Where the consent was given.")] = "cli",
) -> None:
    """Record that a subject consents to capture for a purpose."""
    with _service(ctx.obj) as service:
        expiry = _parse_time(expires_at, "expires_at")
        record = service.grant(tenant, user, subject, purpose, policy_version, expiry, source,
                               _actor())
    typer.echo(json.dumps(record_fields(record)))


@consent_app.command()
def revoke(
    ctx: typer.Context,
    tenant: Tenant,
    user: User = None,
    subject: Subject = None,
    purpose: Annotated[str | None, typer.Option(help="Purpose; default: all.")] = None,
    erase: Annotated[bool, typer.Option(help="Also erase the subject's stored traces.")] = False,
) -> None:
    """Revoke a subject's consent; with --erase, also rewrite their traces out of Parquet."""
    with _service(ctx.obj) as service:
        outcome = service.revoke(tenant, user, subject, purpose, erase, _actor())
    typer.echo(json.dumps({"revoked": [record_fields(r) for r in outcome.revoked],
                           "erasure": outcome.erasure}))


@consent_app.command("list")
def list_(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option(help="Tenant name.")] = None,
    user: User = None,
    subject: Subject = None,
    purpose: Purpose = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """List consent records, oldest first."""
    with _service(ctx.obj) as service:
        records = service.list(tenant, user, subject, purpose)
    if as_json:
        for record in records:
            typer.echo(json.dumps(record_fields(record)))
    else:
        typer.echo("\t".join(_COLUMNS))
        for record in records:
            typer.echo("\t".join(_row(record)))


@contextmanager
def _service(erase_traces: TraceEraser) -> Iterator[ConsentService]:
    """The service over the configured registry; operator errors exit with status 2."""
    try:
        config = ConsentSettings().resolve()
        tenants = TenantDirectory.load(config.tenants_path)
    except ValueError as exc:
        _fail(str(exc))
    registry = ConsentRegistry(config.registry_path)
    try:
        yield ConsentService(registry, config, tenants, erase_traces)
    except InvalidField as exc:
        _fail(f"--{exc.field.replace('_', '-')}: {exc.message}")
    finally:
        registry.close()


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _parse_time(value: str | None, field: str) -> datetime | None:
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError as exc:
        raise InvalidField(field, f"not an ISO 8601 time: {value!r}") from exc


def _actor() -> str:
    return f"cli:{getpass.getuser()}"


_COLUMNS = ("consent_id", "tenant", "subject", "purpose", "policy_version", "granted_at",
            "expires_at", "revoked_at")


def _row(record: ConsentRecord) -> list[str]:
    """Tab-separated cells: greppable, and never cropped to the terminal width."""
    fields = record_fields(record)
    return [fields[c] or "-" for c in _COLUMNS]
