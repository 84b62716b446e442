"""SQL lives in schemas/, one module per table group (ARCHITECTURE.md, "Code map").

Every product module is parsed (never imported). Outside ``schemas/`` no string may hold a
SQL statement and no module may build one with SQLAlchemy; the replay's sinks are the one
exception, because they write the warehouse's own tables (DuckDB, Parquet, a Postgres
warehouse, Iceberg), never koda's. Inside ``schemas/`` a run is inserted by one statement,
and no statement writes a run's status as a literal: statuses come from the state machine's
edges as parameters.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("koda", "cli", "gateway", "processors", "scheduler", "topics", "schemas")
OWNER = "schemas"
# The replay writes into a warehouse (its own DuckDB/Postgres/Parquet/Iceberg tables).
WAREHOUSE = ("topics/replay/sinks/", "topics/replay/sql.py")
# Migrations are DDL history, written once and never changed.
HISTORY = ("schemas/migrations/",)

STATEMENT = re.compile(
    r"\bSELECT\b[\s\S]+?\bFROM\b|\b(INSERT|MERGE)\s+INTO\b|\bUPDATE\s+\w+\s+SET\b|\bDELETE\s+FROM\b"
)
BUILDERS = {"text", "select", "insert", "update", "delete"}
INSERT_RUN = re.compile(r"\bINSERT\s+INTO\s+runs\b")
LITERAL_STATUS = re.compile(r"\bUPDATE\s+runs\s+SET\b[\s\S]*?\bstatus\s*=\s*'", re.IGNORECASE)


def modules(*folders: str) -> Iterator[tuple[str, ast.AST]]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(HISTORY):
                continue
            yield rel, ast.parse(path.read_text(), rel)


def strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each string constant, and each f-string's literal parts joined (the SQL shape)."""
    inside_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
            inside_fstring.update(id(v) for v in node.values)
            yield node.lineno, " ? ".join(str(p) for p in parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in inside_fstring:
                yield node.lineno, node.value


def docstrings(tree: ast.AST) -> set[int]:
    """Line numbers of docstrings: prose about SQL is not SQL."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(body[0].value.lineno)
    return found


def sql_outside_owner(rel: str, tree: ast.AST) -> list[str]:
    if rel.startswith((f"{OWNER}/", *WAREHOUSE)):
        return []
    found = []
    skip = docstrings(tree)
    for line, value in strings(tree):
        if line not in skip and STATEMENT.search(value):
            found.append(f"{rel}:{line}: SQL statement {value.strip()[:60]!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            built = sorted(a.name for a in node.names if a.name in BUILDERS)
            if built:
                found.append(f"{rel}:{node.lineno}: builds SQL with sqlalchemy {built}")
    return found


def test_only_schemas_speaks_sql() -> None:
    found = [hit for rel, tree in modules(*PRODUCT) for hit in sql_outside_owner(rel, tree)]
    assert not found, "SQL outside schemas/ (move it to the table group's module):\n" + "\n".join(
        found
    )


def test_a_run_is_inserted_by_one_statement() -> None:
    found = [
        f"{rel}:{line}"
        for rel, tree in modules(*PRODUCT)
        for line, value in strings(tree)
        if INSERT_RUN.search(value)
    ]
    assert len(found) == 1, found


def test_no_statement_writes_a_status_literal() -> None:
    found = [
        f"{rel}:{line}"
        for rel, tree in modules(*PRODUCT)
        for line, value in strings(tree)
        if LITERAL_STATUS.search(value)
    ]
    assert not found, "status writes take the state machine's edges as parameters:\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("gateway/x.py", 'Q = "SELECT id FROM runs WHERE id = :id"\n', "SQL statement"),
        ("processors/x.py", 'Q = f"DELETE FROM {table} WHERE x = 1"\n', "SQL statement"),
        ("gateway/x.py", "from sqlalchemy import text\n", "builds SQL"),
        ("topics/replay/x.py", 'Q = """\n  INSERT INTO runs (id) VALUES (:id)\n"""\n', "SQL"),
    ],
    ids=["select-in-gateway", "fstring-delete", "sqlalchemy-text", "replay-outside-sinks"],
)
def test_the_check_finds_planted_sql(rel: str, source: str, expected: str) -> None:
    hits = sql_outside_owner(rel, ast.parse(source))
    assert any(expected in h for h in hits), hits


def test_the_check_leaves_owners_prose_and_sinks_alone() -> None:
    statement = 'Q = "SELECT id FROM runs"\n'
    assert sql_outside_owner("schemas/runs/reads.py", ast.parse(statement)) == []
    assert sql_outside_owner("topics/replay/sinks/duckdb.py", ast.parse(statement)) == []
    prose = '"""We SELECT the rows FROM the topic, never the table."""\n'
    assert sql_outside_owner("gateway/x.py", ast.parse(prose)) == []


def test_a_literal_status_write_is_found() -> None:
    planted = "UPDATE runs SET status = 'cancelled' WHERE id = :id"
    assert LITERAL_STATUS.search(planted)
    assert not LITERAL_STATUS.search("UPDATE runs SET status = :to WHERE status = ANY(:from)")
