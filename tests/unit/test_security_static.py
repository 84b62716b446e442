"""Security basics that need no service: SQL is built with bound parameters only, and the
Kafka TLS/SASL settings reach every client's configuration (librdkafka, aiokafka, Faust).
"""

from __future__ import annotations

import ast
import re
import ssl
from pathlib import Path

import certifi
import faust
import pytest

from koda_runtime.kafka import aiokafka_security, consumer_config, producer_config
from koda_runtime.processors.faust_app import faust_settings
from koda_runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("koda", "cli", "gateway", "processors", "scheduler", "topics", "schemas")
SQL = re.compile(
    r"\b(SELECT\b.*\bFROM|INSERT\s+INTO|MERGE\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM"
    r"|TRUNCATE\s+\w"
    r"|(CREATE|ALTER|DROP)\s+(TABLE|SCHEMA|DATABASE|INDEX|VIEW|ROLE))\b",
    re.IGNORECASE | re.DOTALL,
)
SQL_CALLS = {"text", "execute", "exec_driver_sql", "executemany"}

# The documented exceptions: SQL text with an interpolated part that is not user input.
ALLOWED = {
    # An identifier: the schema name made by the naming function (validated, quoted).
    ("schemas/migrate.py", 'CREATE SCHEMA IF NOT EXISTS "{schema}"'),
    # A constant of the local stack's launcher.
    ("koda/localstack/postgres.py", 'create database "{DATABASE}"'),
    # The replay sinks' statements: table, column and key names from the code constants
    # of topics/replay/tables.py, every value a bound parameter (topics/replay/sql.py).
    ("topics/replay/sql.py", "CREATE TABLE IF NOT EXISTS {table.name} ({cols}"),
    ("topics/replay/sql.py", "ALTER TABLE {table.name} ADD COLUMN IF NOT EXISTS {c.name}"),
    ("topics/replay/sql.py", "INSERT INTO {table.name} AS cur ({cols}) SELECT {cols}"),
    ("topics/replay/sql.py", "MERGE INTO {table.name} AS cur USING {source} AS excluded"),
    ("topics/replay/sql.py", "ALTER TABLE {table.name} ADD COLUMN IF NOT EXISTS {c.name}"),
    ("topics/replay/sql.py", "SELECT count(*) FROM {table.name}"),
    ("topics/replay/sql.py", "INSERT INTO _dirty SELECT DISTINCT '{table.name}'"),
    ("topics/replay/sql.py", "SELECT {cols} FROM {table.name} WHERE day = ?"),
    ("topics/replay/sql.py", "SELECT {cols} FROM {source} QUALIFY row_number()"),
    # A chunk poll's checks, generated from the record spec (names, numbers, a regex).
    ("topics/replay/sql.py", "json_transform(value, '{shape}') AS p FROM {poll}"),
    # The usage reports: the group key is one of four fixed expressions chosen by code
    # (schemas/ledger.py _KEYS), every value a bound parameter.
    ("schemas/ledger.py", "SELECT {key} AS k, {_FIGURES} FROM ledger {_WHERE}"),
    ("schemas/ledger.py", "SELECT {_FIGURES} FROM ledger {_WHERE}"),
    # The runs history: whose runs is one of two fixed conditions chosen by code (a
    # user's, or the operators' optional user), every value a bound parameter.
    ("schemas/runs/control.py", "_LIST_RUNS_SQL.format(who="),
    # The visible-output rule written once (schemas/runs/reads.py visible_output_sql):
    # the calling statement's run-id column and the lifecycle's chunk kinds, code
    # constants; the statements that embed it bind every value.
    ("schemas/runs/reads.py", "WHERE m.run_id = {run_id} AND m.kind = '{_ANSWER_KIND}'"),
    ("schemas/runs/reads.py", "{visible_output_sql('r.id')} AS"),
    ("schemas/runs/reads.py", "{visible_output_sql('e.id')} AS"),
    # The warehouse schema as a quoted identifier (psycopg's sql.Identifier).
    ("topics/replay/sinks/postgres.py", "pgsql.Identifier(self.schema)"),
}


def _literal_text(node: ast.AST) -> str:
    """The constant parts of an f-string, %-format, concatenation or .format() call."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal_text(v) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _literal_text(node.left) + _literal_text(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _literal_text(node.func.value)
    return ""


def _dynamic(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
    )


def sql_built_from_strings(source: str, path: str) -> list[tuple[str, int, str]]:
    """Every SQL-looking string built by interpolation, and every SQL call whose text is
    not a plain literal, a module-level name or a bound-parameter construct."""
    found: list[tuple[str, int, str]] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.expr) and _dynamic(node) and SQL.search(_literal_text(node)):
            found.append((path, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in SQL_CALLS and node.args and _dynamic(node.args[0]):
                found.append((path, node.lineno, ast.unparse(node.args[0])))
    return found


def test_the_scanner_finds_interpolated_sql() -> None:
    bad = """
from sqlalchemy import text
def f(conn, run_id, col):
    conn.execute(text(f"SELECT * FROM runs WHERE id = '{run_id}'"))
    q = "DELETE FROM runs WHERE id = '%s'" % run_id
    conn.execute(text("UPDATE runs SET " + col + " = 1"))
    conn.exec_driver_sql("select {}".format(run_id))
    conn.execute(text("SELECT 1 FROM runs WHERE id = :id"), {"id": run_id})
"""
    lines = sorted({line for _, line, _ in sql_built_from_strings(bad, "x.py")})
    assert lines == [4, 5, 6, 7]


def test_sql_is_built_with_bound_parameters_only() -> None:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += sql_built_from_strings(path.read_text(), rel)
    unexpected = [
        f"{p}:{line}: {code}"
        for p, line, code in found
        if not any(p == ap and snippet in code for ap, snippet in ALLOWED)
    ]
    assert not unexpected, "SQL built from strings:\n" + "\n".join(unexpected)
    # Every documented exception still exists (a stale list would hide a new one).
    for ap, snippet in ALLOWED:
        assert any(p == ap and snippet in code for p, _, code in found), (ap, snippet)


def secure(protocol: str, **extra: str) -> Settings:
    env = {
        "APP_ENV": "dev",
        "KODA_KAFKA_SECURITY_PROTOCOL": protocol,
        "KODA_KAFKA_SSL_CAFILE": certifi.where(),
        **extra,
    }
    return Settings.from_env(env)


SASL = {
    "KODA_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "KODA_KAFKA_SASL_USERNAME": "koda-worker",
    "KODA_KAFKA_SASL_PASSWORD": "s3cret-pw",
}


def test_sasl_ssl_reaches_librdkafka_aiokafka_and_faust() -> None:
    settings = secure("SASL_SSL", **SASL)
    for conf in (producer_config(settings, "gateway"), consumer_config(settings, "x", "g")):
        assert conf["security.protocol"] == "SASL_SSL"
        assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
        assert conf["sasl.username"] == "koda-worker"
        assert conf["sasl.password"] == "s3cret-pw"
        assert conf["ssl.ca.location"] == certifi.where()
    kw = aiokafka_security(settings)
    assert kw["security_protocol"] == "SASL_SSL"
    assert kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("koda-worker", "s3cret-pw")
    context = kw["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    creds = faust_settings(settings, "/tmp")["broker_credentials"]  # noqa: S108
    assert isinstance(creds, faust.SASLCredentials)
    # Faust derives the protocol from the credentials: it must be TLS, not plaintext.
    assert creds.protocol.value == "SASL_SSL"
    assert creds.ssl_context is context or isinstance(creds.ssl_context, ssl.SSLContext)
    assert "s3cret-pw" not in repr(settings)


def test_ssl_without_sasl_reaches_faust_as_tls() -> None:
    settings = secure("SSL")
    assert producer_config(settings, "gateway")["security.protocol"] == "SSL"
    assert aiokafka_security(settings)["security_protocol"] == "SSL"
    creds = faust_settings(settings, "/tmp")["broker_credentials"]  # noqa: S108
    assert isinstance(creds, faust.SSLCredentials)
    assert creds.protocol.value == "SSL"


def test_sasl_plaintext_and_plaintext_carry_no_tls() -> None:
    sasl = secure("SASL_PLAINTEXT", **SASL)
    assert "ssl_context" not in aiokafka_security(sasl)
    creds = faust_settings(sasl, "/tmp")["broker_credentials"]  # noqa: S108
    assert creds.protocol.value == "SASL_PLAINTEXT"
    plain = Settings.from_env({"APP_ENV": "dev"})
    assert producer_config(plain, "gateway")["security.protocol"] == "PLAINTEXT"
    assert faust_settings(plain, "/tmp")["broker_credentials"] is None  # noqa: S108


def test_an_unknown_protocol_is_refused_with_the_choices() -> None:
    with pytest.raises(Exception, match="SASL_SSL"):
        secure("TLS")


def test_the_console_fits_its_csp_and_never_puts_a_token_in_a_url() -> None:
    """The CSP (gateway/console.py) allows no inline script or style, no eval and no
    data: URL; the page must need none, and streams with tickets, not ``?access_token=``."""
    static = ROOT / "gateway" / "console_static"
    page = (static / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", page) == [
        '<script type="module" src="/console/assets/console.js">'
    ]
    assert not re.search(r"\son\w+=|\sstyle=|<style|javascript:|data:", page, re.IGNORECASE)
    assert re.search(r'<input id="token"[^>]*type="password"', page)
    code = [line.split("//")[0] for line in (static / "console.js").read_text().splitlines()]
    script = "\n".join(code)  # without comments (which name what is never done)
    for forbidden in ("access_token", ".innerHTML", "eval(", "new Function", "document.write"):
        assert forbidden not in script, forbidden
    assert "/stream-ticket" in script
