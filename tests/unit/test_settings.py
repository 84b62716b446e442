"""Settings: each knob declared once, read by one loop, refused in one format.

The declarations in koda/settings.py carry each variable's type, default, unit and
bounds; these tests hold the loader, the refusals, docs/settings.md's table and the deploy
files to them.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from koda_runtime import settingsdoc
from koda_runtime.errors import ConfigError
from koda_runtime.knobs import Knob, knobs
from koda_runtime.naming import AppEnv
from koda_runtime.settings import OTHER_VARIABLES, KafkaSecurity, ServiceToken, Settings

ROOT = Path(__file__).resolve().parents[2]
DEV = {"APP_ENV": "dev"}
ALL = [
    (cls, name, kind, spec) for cls in (Settings, KafkaSecurity) for name, kind, spec in knobs(cls)
]
NUMBERS = [(name, kind, spec) for _, name, kind, spec in ALL if kind in (int, float)]


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as exc:
        Settings.from_env(DEV | env)
    return str(exc.value)


def test_a_bad_integer_names_the_variable_the_value_and_the_range() -> None:
    assert (
        refusal({"KODA_PARTITIONS": "many"}) == "KODA_PARTITIONS='many': use an integer in 1..4096"
    )
    assert refusal({"KODA_SSE_RETRY_MS": "1.5"}) == (
        "KODA_SSE_RETRY_MS='1.5': use an integer in 0..600000 (ms)"
    )


def test_an_out_of_range_value_names_the_variable_the_value_and_the_range() -> None:
    assert refusal({"KODA_MAX_ATTEMPTS": "11"}) == "KODA_MAX_ATTEMPTS='11': use an integer in 1..10"
    assert refusal({"KODA_HANDOFF_CEILING": "0.01"}) == (
        "KODA_HANDOFF_CEILING='0.01': use a number in 0.1..600 (s)"
    )
    assert refusal({"KODA_LOOP_STALL": "nan"}).startswith("KODA_LOOP_STALL='nan': use a number")


def test_a_bad_choice_and_a_bad_boolean_name_the_variable_and_the_choices() -> None:
    assert (
        refusal({"KODA_EMBEDDER": "bert"}) == "KODA_EMBEDDER='bert': use one of wordllama, openai"
    )
    assert refusal({"KODA_KAFKA_SECURITY_PROTOCOL": "TLS"}) == (
        "KODA_KAFKA_SECURITY_PROTOCOL='TLS': use one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"
    )
    assert refusal({"KODA_MEMORY": "maybe"}) == "KODA_MEMORY='maybe': use true or false"


def test_a_bad_secret_is_named_but_never_echoed() -> None:
    message = refusal({"KODA_API_TOKENS": "s3cret-token-without-user"})
    assert message == ("KODA_API_TOKENS=<hidden>: use a comma-separated list of token:user_id")
    assert "s3cret" not in message


def test_a_choice_is_checked_however_the_settings_are_built() -> None:
    with pytest.raises(ConfigError, match="^KODA_EMBEDDER='bert': use one of"):
        Settings(app_env=AppEnv.DEV, embedder="bert")
    with pytest.raises(ConfigError, match="^KODA_KAFKA_SECURITY_PROTOCOL='TLS'"):
        KafkaSecurity(protocol="TLS")
    with pytest.raises(ConfigError, match="^KODA_TEST_FAULT='x'"):
        Settings(app_env=AppEnv.DEV).with_(test_fault="x")


@pytest.mark.parametrize(("name", "kind", "spec"), NUMBERS, ids=[s.env for _, _, s in NUMBERS])
def test_every_number_is_bounded_and_refused_past_its_bounds(
    name: str, kind: type, spec: Knob
) -> None:
    assert spec.lo is not None and spec.hi is not None, f"{spec.env} has no bounds"
    above = str(int(spec.hi) + 1)
    assert refusal({spec.env: above}).startswith(f"{spec.env}='{above}': use {spec.allowed(kind)}")
    below = str(int(spec.lo) - 1)
    assert refusal({spec.env: below}).startswith(f"{spec.env}='{below}': use ")
    assert refusal({spec.env: "x"}).startswith(f"{spec.env}='x': use ")


def test_unset_and_empty_variables_give_the_declared_defaults() -> None:
    unset = Settings.from_env(DEV)
    empty = Settings.from_env(DEV | {spec.env: "" for *_, spec in ALL})
    declared = Settings(app_env=AppEnv.DEV)
    for cls, name, _, _ in ALL:
        assert getattr(part(unset, cls), name) == getattr(part(declared, cls), name), name
        assert getattr(part(empty, cls), name) == getattr(part(declared, cls), name), name


def part(settings: Settings, cls: type) -> Any:
    """The object holding ``cls``'s knobs: the settings or their Kafka security."""
    return settings if cls is Settings else settings.kafka_security


# A value of each knob read by a parse function, and what it reads as.
PARSED: dict[str, tuple[str, Any]] = {
    "KODA_CHUNK_RETENTION": ("2d", 2 * 86400.0),
    "KODA_RUN_RETENTION": ("12h", 12 * 3600.0),
    "KODA_LEDGER_RETENTION": ("6w", 42 * 86400.0),
    "KODA_SERVICE_TOKENS": (
        "tok:backend:submit+read",
        {"tok": ServiceToken("backend", frozenset({"submit", "read"}))},
    ),
}


def test_every_variable_reaches_its_field() -> None:
    """One value per knob, in range, set through the environment, lands in its field."""
    defaults = {f.name: f.default for cls in (Settings, KafkaSecurity) for f in fields(cls)}
    env: dict[str, str] = {}
    want: dict[str, Any] = {}
    for cls, name, kind, spec in ALL:
        raw: str
        value: Any
        default = defaults[name]
        if spec.choices:
            raw, value = spec.choices[-1], spec.choices[-1]
        elif spec.parse is not None:
            raw, value = PARSED.get(spec.env, ("tok:user", {"tok": "user"}))
        elif kind in (int, float):
            assert spec.lo is not None and spec.hi is not None
            # the lower bound, or the upper one where the default is the lower one (and
            # for the rebalance timeout, so that the handoff ceiling fits below it)
            top = spec.lo == default or spec.env == "KODA_REBALANCE_TIMEOUT"
            number = kind(spec.hi if top else spec.lo)
            raw, value = str(number), number
        elif kind is bool:
            raw, value = ("false", False) if default else ("true", True)
        else:
            raw, value = "x-1", "x-1"
        assert value != default, spec.env
        env[spec.env] = raw
        want[f"{cls.__name__}.{name}"] = value
    # Cross-field rules: a power-of-two partition count, the ceiling below the rebalance
    # timeout, stale after the beat interval, 3..5 memories when on.
    env |= {"KODA_PARTITIONS": "1", "KODA_BEAT_STALE_AFTER": "1", "KODA_MEMORY_AUTO_INJECT": "3"}
    want |= {
        "Settings.partitions": 1,
        "Settings.beat_stale_after_s": 1.0,
        "Settings.memory_auto_inject": 3,
    }
    settings = Settings.from_env(DEV | env)
    for key, value in want.items():
        cls_name, name = key.split(".")
        obj = settings if cls_name == "Settings" else settings.kafka_security
        assert getattr(obj, name) == value, key


def test_each_variable_is_declared_once() -> None:
    names = [spec.env for *_, spec in ALL] + [env for env, _, _ in OTHER_VARIABLES]
    assert len(names) == len(set(names))
    assert all(spec.doc for *_, spec in ALL)
    undeclared = {f.name for f in fields(Settings) if not f.metadata and f.name not in _COMPUTED}
    assert undeclared == set(), "a setting without a knob declaration"


_COMPUTED = {"app_env", "kafka_security", "worker_id", "worker_id_source", "origins"}


def test_the_settings_table_is_rendered_from_the_declarations(tmp_path: Path) -> None:
    readme = (ROOT / "docs" / "settings.md").read_text()
    assert settingsdoc.rendered(readme) == readme, "run python -m koda_runtime.settingsdoc"
    for *_, spec in ALL:
        assert f"| `{spec.env}` |" in readme
    # and the check notices a stale one
    stale = tmp_path / "settings.md"
    stale.write_text(readme.replace("| `KODA_PARTITIONS` | `32` |", "| `KODA_PARTITIONS` | `16` |"))
    assert settingsdoc.main(["--check", str(stale)]) == 1
    assert settingsdoc.main([str(stale)]) == 0
    assert stale.read_text() == readme
    (tmp_path / "bare.md").write_text("# no table\n")
    with pytest.raises(ValueError, match="settings table markers"):
        settingsdoc.main([str(tmp_path / "bare.md")])


def deploy_variables() -> dict[str, set[str]]:
    """Every KODA_ variable the deploy files set, by file."""
    found: dict[str, set[str]] = {}
    configmap = yaml.safe_load((ROOT / "deploy/k8s/configmap.yaml").read_text())
    found["deploy/k8s/configmap.yaml"] = set(configmap["data"])
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    names: set[str] = set()
    for service in compose["services"].values():
        names |= set(service.get("environment") or {})
    names |= set(compose.get("x-koda", {}).get("environment") or {})
    found["deploy/compose.yaml"] = names
    for path in sorted((ROOT / "deploy/k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for c in _containers(doc):
                found.setdefault(str(path.relative_to(ROOT)), set()).update(
                    e["name"] for e in c.get("env", [])
                )
    return {k: {n for n in v if n.startswith("KODA_")} for k, v in found.items()}


def _containers(doc: Any) -> list[dict[str, Any]]:
    spec = (doc or {}).get("spec", {})
    pod = spec.get("template", {}).get("spec", spec.get("jobTemplate", {}))
    return list(pod.get("containers", [])) if isinstance(pod, dict) else []


def test_the_deploy_files_set_only_variables_koda_reads() -> None:
    known = {spec.env for *_, spec in ALL} | {env for env, _, _ in OTHER_VARIABLES}
    files = deploy_variables()
    assert files["deploy/k8s/configmap.yaml"] and files["deploy/compose.yaml"]
    for path, names in files.items():
        assert names <= known, f"{path} sets {sorted(names - known)}, which nothing reads"
    assert {"KODA_TOPIC_AUTOCREATE", "KODA_METRICS_PORT"}.isdisjoint(known)
