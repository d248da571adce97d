"""Retrain policies: every shipped example validates, and a bad file gets one error per problem
naming the field and its line."""

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specloop.daemon.retrain import cli
from specloop.daemon.retrain.policy import PolicyError, RetrainPolicy, load_policy, parse_policy
from specloop.daemon.stack import POLICIES

EXAMPLES = sorted(POLICIES.glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path: Path) -> None:
    assert isinstance(load_policy(path), RetrainPolicy)


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"default.yaml", "demo.yaml", "approval.yaml"}


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return str(e.value).splitlines()


def test_errors_name_field_and_line() -> None:
    text = "schedule:\n  interval_minutes: 5\ngate:\n  min_relative_gain: -2\ntraining:\n  max_steps: 0\n"
    assert errors(text) == ["p.yaml: training.max_steps (line 6): Input should be greater than 0",
                            "p.yaml: gate.min_relative_gain (line 4): Input should be greater than or equal to -1"]


def test_a_misspelt_key_is_an_error_not_a_default() -> None:
    (line,) = errors("schedule: {interval_minutes: 5}\ngate:\n  require_aproval: true\n")
    assert line == "p.yaml: gate.require_aproval (line 3): Extra inputs are not permitted"


def test_schedule_needs_exactly_one_of_cron_and_interval() -> None:
    assert "give exactly one of cron or interval_minutes" in errors("schedule: {}\n")[0]
    assert "give exactly one" in errors("schedule: {cron: '* * * * *', interval_minutes: 1}\n")[0]
    (line,) = errors("cooldown_minutes: 1\nschedule:\n  cron: '61 * * * *'\n")
    assert line.startswith("p.yaml: schedule (line 3): Value error, cron '61 * * * *' is not a crontab line")


def test_missing_schedule_and_wrong_types() -> None:
    assert errors("triggers: {min_new_traces: 5}\n") == ["p.yaml: schedule (line 1): Field required"]
    (line,) = errors("schedule: {interval_minutes: 5}\nevaluation:\n  slices: [tenant, region]\n")
    assert line.startswith("p.yaml: evaluation.slices.1 (line 3): Input should be 'tenant' or 'endpoint'")


def test_a_first_drafters_prompt_file_must_exist_and_its_count_is_bounded(tmp_path: Path) -> None:
    missing = tmp_path / "no.jsonl"
    (line,) = errors(f"schedule: {{interval_minutes: 5}}\ndata:\n  first_drafter_prompts_file: {missing}\n")
    assert line.startswith("p.yaml: data.first_drafter_prompts_file (line 3): Path does not point to a file")
    (line,) = errors("schedule: {interval_minutes: 5}\ndata: {first_drafter_prompts: 100000}\n")
    assert line == "p.yaml: data.first_drafter_prompts (line 2): Input should be less than or equal to 4096"
    assert parse_policy("schedule: {interval_minutes: 5}\n").data.first_drafter_prompts == 128


def test_not_yaml_or_not_a_mapping() -> None:
    assert errors("schedule: [1,\n")[0].startswith("p.yaml (line 2): not valid YAML")
    assert errors("- 1\n") == ["p.yaml: a policy is a YAML mapping with at least a `schedule` section"]


def test_defaults_fill_every_section() -> None:
    policy = parse_policy("schedule: {interval_minutes: 30}\n")
    assert policy.gate.min_relative_gain == 0.02 and policy.rollout.rollback_below == 0.9
    assert policy.training.warm_start and policy.triggers.min_new_traces == 200


def test_validate_command(tmp_path: Path) -> None:
    app = typer.Typer()
    cli.register(app)
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule: {interval_minutes: 0}\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["policy", "validate", str(EXAMPLES[0])])
    assert ok.exit_code == 0 and ok.output.strip().endswith(": ok")
    failed = runner.invoke(app, ["policy", "validate", str(EXAMPLES[0]), str(bad)])
    assert failed.exit_code == 1
    assert "schedule.interval_minutes (line 1): Input should be greater than 0" in failed.output
    missing = runner.invoke(app, ["policy", "validate", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 1 and "cannot read the policy" in missing.output
