"""Records in, warehouse rows out: one batch of upserts (see tables.py for the tables).

What each topic becomes:

    runs          run.requested/1  → runs (identity; status ``pending`` until an event)
    run-events    run.event/1      → run_transitions + runs (latest state), or usage
    run-chunks    run.chunk/1      → chunks (the sink then rebuilds the run's outputs row)
                  run.final/1      → outputs (compacted: the final text wins)
                  tombstone        → counted, nothing deleted: the warehouse keeps what it read
    runs-dlq      run.dead-letter/1 → dead_letters

A record whose schema header names an unknown record type or version, or that does not
decode, goes to ``raw_records`` with its bytes and the reason: nothing is dropped, but
the records of an erased user (erased.py), which the decoder drops and counts.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import date
from operator import itemgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from koda_runtime.errors import RecordError
from koda_runtime.lifecycle.chunks import SEQ_WIDTH, split_chunk_key
from koda_runtime.lifecycle.states import TERMINAL, RunStatus
from koda_runtime.naming import Names
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS, RUNS_DLQ
from koda_runtime.topics.records import formats as spec
from koda_runtime.topics.records.codec import (
    CURRENT_VERSION,
    DEAD_LETTER,
    RUN_CHUNK,
    RUN_EVENT,
    RUN_FINAL,
    decode_chunk_value,
    decode_final_value,
    decode_run_requested,
    header_value,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import DeadLetter, decode_dead_letter
from koda_runtime.topics.records.events import Transition, decode_run_event, parse_instant
from koda_runtime.topics.records.specs import Field
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.batch import (
    Message,
    RowBatch,
    instant,
    read_all,
    run_day,
    uuid7_day,
)
from koda_runtime.topics.replay.chunk_polls import ChunkPolls, runs_and_days
from koda_runtime.topics.replay.erased import Erased, ledger_user
from koda_runtime.topics.replay.prices import PriceBook

__all__ = ["REPLAYABLE", "RecordDecoder", "RowBatch", "run_day"]

REPLAYABLE = (RUNS, RUN_EVENTS, RUN_CHUNKS, RUNS_DLQ)
# A terminal transition outranks any other event of its run, whatever its offset:
# terminal states have no outgoing edge (docs/design.md §4).
TERMINAL_RANK = 1 << 62


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _headers_json(headers: Any) -> str:
    return json.dumps([[k, _b64(v)] for k, v in headers or []])


class RecordDecoder:
    """Turns records of the replayable topics into rows of a :class:`RowBatch`."""

    DAY_CACHE = 100_000  # run ids whose day is remembered (a run's records come together)

    def __init__(
        self,
        names: Names,
        prices: PriceBook,
        *,
        arrow_chunks: bool = False,
        erased: Erased | None = None,
    ) -> None:
        """``arrow_chunks``: decode polls of chunk records in DuckDB into Arrow parts
        (:mod:`~koda_runtime.topics.replay.chunk_polls`), for a sink that takes them.
        ``erased``: the erased users, whose records are dropped (erased.py)."""
        self.bases = {names.topic(b): b for b in REPLAYABLE}
        self.chunk_topic = names.topic(RUN_CHUNKS)
        self.runs_topic = names.topic(RUNS)
        self.prices = prices
        self._days: dict[str, date] = {}
        self.polls = ChunkPolls() if arrow_chunks else None
        self.erased = erased if erased is not None else Erased()

    def close(self) -> None:
        """Close the DuckDB of the chunk polls (again: nothing); the parts it gave stay."""
        if self.polls is not None:
            self.polls.close()
            self.polls = None

    def _day(self, run_id: str, ts_ms: int) -> date:
        """:func:`run_day`, remembered per run (the fallback is never remembered)."""
        day = self._days.get(run_id)
        if day is None:
            day = uuid7_day(run_id)
            if day is None:
                return instant(ts_ms).date()
            if len(self._days) >= self.DAY_CACHE:
                self._days.clear()
            self._days[run_id] = day
        return day

    def add_many(self, msgs: Sequence[Message], batch: RowBatch, topic: str | None = None) -> None:
        """:meth:`add` for each of ``msgs`` in order, a poll's worth of chunk records at
        once where that gives the same rows (see :func:`chunk_columns`). ``topic``: the
        topic every one of ``msgs`` is on, when the caller knows (a reader of one topic);
        else each record's is read."""
        if topic is None:
            chunks = self._all_chunks(msgs)
        else:
            chunks = bool(msgs) and topic == self.chunk_topic
        values = read_all(msgs, "value") if chunks else []
        plain = chunks and _plain_values_and_headers(values, msgs)
        if plain and self.polls is not None:
            part = self.polls.decode(msgs, values)
            if part is not None:
                if self.erased.runs:
                    part = self._without_erased(part)
                batch.add_chunk_part(part, runs_and_days(part), len(msgs))
                return
        columns = _plain_poll_columns(msgs, values) if plain else None
        if columns is None:
            for msg in msgs:
                self.add(msg, batch)
            return
        if self.erased.runs:
            kept = [i for i, r in enumerate(columns[0]) if r not in self.erased.runs]
            self.erased.dropped += len(msgs) - len(kept)
            batch.records += len(msgs) - len(kept)
            columns = tuple([c[i] for i in kept] for c in columns)
            msgs = [msgs[i] for i in kept]
            if not msgs:
                return
        run_ids, seqs, kinds, contents, attempts = columns
        days = self._days
        day_of = [
            days.get(run_id) or self._day(run_id, msg.timestamp()[1])
            for run_id, msg in zip(run_ids, msgs, strict=True)
        ]
        # Every chunks column but the key is "last wins", so an update in offset order
        # leaves what merging row by row leaves.
        batch.rows[t.CHUNKS.name].update(
            zip(
                zip(run_ids, seqs, strict=True),
                zip(run_ids, seqs, day_of, kinds, contents, attempts, strict=True),
                strict=True,
            )
        )
        batch.chunk_runs.update(zip(run_ids, day_of, strict=True))
        batch.records += len(msgs)

    def _without_erased(self, part: pa.Table) -> pa.Table:
        """``part`` without the rows of erased runs (counted as dropped)."""
        erased = pa.array(sorted(self.erased.runs), pa.string())
        kept = part.filter(pc.invert(pc.is_in(part["run_id"], value_set=erased)))
        self.erased.dropped += part.num_rows - kept.num_rows
        return kept

    def _all_chunks(self, msgs: Sequence[Message]) -> bool:
        return bool(msgs) and read_all(msgs, "topic").count(self.chunk_topic) == len(msgs)

    def add(self, msg: Message, batch: RowBatch) -> None:
        batch.records += 1
        topic = msg.topic() or ""
        base = self.bases[topic]
        ts = msg.timestamp()[1]
        try:
            if base == RUNS:
                self._run_requested(msg, ts, batch)
            elif base == RUN_EVENTS:
                self._run_event(msg, ts, batch)
            elif base == RUN_CHUNKS:
                self._chunk(msg, ts, batch)
            else:
                self._dead_letter(msg, ts, batch)
        except RecordError as exc:
            if self._erased_key(msg, base):
                self.erased.dropped += 1
                return
            self._raw(msg, ts, batch, exc.reason, exc.detail)

    def _erased_key(self, msg: Message, base: str) -> bool:
        """Whether a record that does not decode is keyed by an erased user or run: the
        runs topic's key is the user id, the others' start with the run id."""
        if not self.erased:
            return False
        key = (msg.key() or b"").decode("utf-8", "replace")
        if base in (RUNS, RUNS_DLQ) and self.erased.user(key):
            return True
        return key.partition(":")[0] in self.erased.runs

    def _expect(self, msg: Message, *names: str) -> None:
        """Raise RecordError unless the schema header (if any) is a known version of ``names``."""
        raw = header_value(msg.headers(), "schema")
        if raw is None:
            return
        name, _, version = raw.decode("utf-8", "replace").partition("/")
        if name not in names:
            raise RecordError("unknown_schema", f"schema {name!r} is not {' or '.join(names)}")
        if version != str(CURRENT_VERSION[name]):
            raise RecordError("unknown_schema_version", f"{name} version {version!r} is not known")

    def _raw(self, msg: Message, ts_ms: int, batch: RowBatch, reason: str, detail: str) -> None:
        schema = header_value(msg.headers(), "schema")
        ts = instant(ts_ms)
        row = (
            msg.topic(),
            msg.partition(),
            msg.offset(),
            ts.date(),
            ts,
            None if schema is None else schema.decode("utf-8", "replace"),
            reason,
            detail[:2000],
            msg.key(),
            msg.value(),
            _headers_json(msg.headers()),
        )
        batch.add(t.RAW_RECORDS, row)
        batch.raw[reason] += 1

    def _run_requested(self, msg: Message, ts: int, batch: RowBatch) -> None:
        req = decode_run_requested(msg.key(), msg.value(), msg.headers())
        try:
            created = parse_instant(req.created_at) if req.created_at else None
        except ValueError:
            created = None
        try:
            scheduled = parse_instant(req.scheduled_for) if req.scheduled_for else None
        except ValueError:
            scheduled = None
        if self.erased.user(req.user_id):
            self.erased.add_run(req.run_id)
            self.erased.dropped += 1
            return
        day = self._day(req.run_id, ts)
        row = (req.run_id, day, req.user_id, req.session_id, created, "pending", 0)
        batch.add(t.RUNS, (*row, None, None, None, -1, None, req.schedule_id, scheduled))

    def _run_event(self, msg: Message, ts: int, batch: RowBatch) -> None:
        self._expect(msg, RUN_EVENT)
        event = decode_run_event(msg.value())
        erased = self.erased
        if erased and not isinstance(event, Transition) and erased.user(event.user_id):
            erased.add_run(event.run_id)
        run_erased = event.run_id in erased.runs
        if run_erased and isinstance(event, Transition):
            erased.dropped += 1
            return
        day = self._day(event.run_id, ts)
        if not isinstance(event, Transition):
            cost = event.cost_usd
            source: str | None = "record"
            if cost is None:
                cost = self.prices.cost(
                    event.model, event.prompt_tokens, event.completion_tokens, event.at
                )
                source = "price_table" if cost is not None else None
            if run_erased:
                erased.dropped += 1  # its usage row; the ledger keeps the call, pseudonymized
            elif event.outcome == "ok":
                row = (event.run_id, event.call_index, day, event.model, event.prompt_tokens)
                batch.add(t.USAGE, (*row, event.completion_tokens, cost, source, event.at))
            user = ledger_user(event.user_id, erased)
            key = (event.run_id, event.attempt, event.call_index, day, user)
            batch.add(
                t.LEDGER,
                (
                    *key,
                    event.model,
                    event.kind,
                    event.prompt_tokens,
                    event.completion_tokens,
                    cost,
                    source,
                    event.price_id,
                    event.outcome,
                    event.estimated,
                    event.at,
                ),
            )
            return
        offset = msg.offset() or 0
        where = (msg.topic(), msg.partition(), offset)
        batch.add(
            t.RUN_TRANSITIONS,
            (
                *where,
                event.run_id,
                day,
                event.to,
                event.attempt,
                event.worker_id,
                event.at,
                event.reason,
            ),
        )
        terminal = event.to in TERMINAL
        claim = event.to == RunStatus.RUNNING.value
        batch.add(
            t.RUNS,
            (
                event.run_id,
                day,
                None,
                None,
                None,
                event.to,
                event.attempt,
                event.at if claim else None,
                event.at if terminal else None,
                event.worker_id if claim else None,
                offset + (TERMINAL_RANK if terminal else 0),
                offset if claim else None,
                None,
                None,
            ),
        )

    def _chunk(self, msg: Message, ts: int, batch: RowBatch) -> None:
        try:
            run_id, seq = split_chunk_key((msg.key() or b"").decode("utf-8", "replace"))
        except ValueError as exc:
            raise RecordError("bad_key", str(exc)) from None
        if msg.value() is None:
            batch.tombstones += 1
            return
        if run_id in self.erased.runs:
            self.erased.dropped += 1
            return
        day = self._day(run_id, ts)
        if seq is None:
            self._expect(msg, RUN_FINAL)
            final = decode_final_value(msg.value())
            if final.run_id != run_id:
                raise RecordError("key_mismatch", "final record's run_id is not its key's")
            row = (run_id, day, final.content, final.end, final.end_content, final.last_seq, True)
            batch.add(t.OUTPUTS, row)
            batch.final_runs.add(run_id)
            return
        self._expect(msg, RUN_CHUNK)
        chunk = decode_chunk_value(msg.value())
        if (chunk.run_id, chunk.seq) != (run_id, seq):
            raise RecordError("key_mismatch", "chunk's run_id and seq are not its key's")
        batch.add(t.CHUNKS, (run_id, seq, day, chunk.kind, chunk.content, chunk.attempt))
        batch.chunk_runs[run_id] = day

    def _erased_letter(self, letter: DeadLetter) -> bool:
        """A letter of an erased user: its original is keyed by the user (a runs record),
        names an erased user, or names a run of one (which it then marks erased)."""
        fields = _original_fields(letter)
        run_id, user = fields.get("run_id"), fields.get("user_id")
        key = None if letter.key is None else letter.key.decode("utf-8", "replace")
        if self.erased.user(key if isinstance(key, str) else None) or (
            isinstance(user, str) and self.erased.user(user)
        ):
            if isinstance(run_id, str):
                self.erased.add_run(run_id)
            return True
        return isinstance(run_id, str) and run_id in self.erased.runs

    def _dead_letter(self, msg: Message, ts: int, batch: RowBatch) -> None:
        self._expect(msg, DEAD_LETTER)
        letter = decode_dead_letter(msg.value())
        if self.erased and self._erased_letter(letter):
            self.erased.dropped += 1
            return
        try:
            at = parse_instant(letter.at) if letter.at else instant(ts)
        except ValueError:
            at = instant(ts)
        batch.add(
            t.DEAD_LETTERS,
            (
                msg.topic(),
                msg.partition(),
                msg.offset(),
                at.date(),
                at,
                letter.reason,
                letter.error,
                letter.attempts,
                _original_run_id(letter),
                letter.topic,
                letter.partition,
                letter.offset,
                letter.key,
                letter.value,
                json.dumps([[k, _b64(v)] for k, v in letter.headers]),
                letter.original_size,
                letter.original_sha256,
                letter.truncated,
                letter.key_size,
                letter.headers_count,
                letter.headers_size,
                letter.key_truncated,
                letter.headers_truncated,
                letter.value_truncated,
            ),
        )


_CHUNK_FIELDS = spec.RUN_CHUNK.fields
_CHUNK_HEADER = ("schema", spec.RUN_CHUNK.header.encode())
_WORKER_CHUNK_HEADERS = headers_for(RUN_CHUNK)  # the headers a worker's chunk record has
_NO_HEADERS: Any = object()  # stands for a record without headers
_PY_TYPES = {"string": str, "integer": int}


def chunk_columns(msgs: Sequence[Message]) -> tuple[list[Any], ...] | None:
    """The ``run.chunk/1`` fields of ``msgs`` as columns (in the spec's field order), or
    None unless every record is a well-formed chunk record that :meth:`RecordDecoder.add`
    would turn into a ``chunks`` row: not a tombstone or a final record, a ``run.chunk/1``
    (or no) schema header first, a UTF-8 JSON object value whose fields keep the spec's
    rules, under its own ``<run_id>:<seq>`` key. None sends the records through the
    per-record path, which gives a bad record its reason."""
    if not plain_chunk_poll(msgs):
        return None  # a tombstone, or a header the per-record path reads further
    return _plain_poll_columns(msgs, read_all(msgs, "value"))


def _plain_poll_columns(msgs: Sequence[Message], values: list[Any]) -> tuple[list[Any], ...] | None:
    """:func:`chunk_columns` of a poll that :func:`plain_chunk_poll` has passed, whose
    values are ``values``."""
    try:
        texts = [v.decode("utf-8") for v in values]  # no tombstone: plain_chunk_poll passed
        # json.loads(text) is _SCAN(text, 0) once leading whitespace is skipped; a text
        # that is not exactly one JSON value without surrounding whitespace is refused.
        objs, ends = zip(*[_SCAN(text, 0) for text in texts], strict=True)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        return None  # not UTF-8, or not JSON
    if list(ends) != list(map(len, texts)) or not all(type(o) is dict for o in objs):
        return None
    try:
        columns = [list(map(itemgetter(f.name), objs)) for f in _CHUNK_FIELDS]
    except KeyError:
        return None  # a field missing
    if not all(_column_keeps(f, c) for f, c in zip(_CHUNK_FIELDS, columns, strict=True)):
        return None
    run_ids, seqs = columns[0], columns[1]
    if max(seqs) >= 10**SEQ_WIDTH:
        return None
    try:
        keys = [f"{r}:{s:0{SEQ_WIDTH}d}".encode() for r, s in zip(run_ids, seqs, strict=True)]
    except UnicodeEncodeError:  # a lone surrogate in the run_id
        return None
    if keys != [m.key() for m in msgs]:
        return None
    return tuple(columns)


# The scanner json.loads runs: (value, end) from an index, or StopIteration.
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def plain_chunk_poll(msgs: Sequence[Message]) -> bool:
    """No tombstone among ``msgs``, and every first header the current chunk schema
    (or none): records the per-record path reads as chunks if their values allow."""
    return _plain_values_and_headers(read_all(msgs, "value"), msgs)


def _plain_values_and_headers(values: list[Any], msgs: Sequence[Message]) -> bool:
    """:func:`plain_chunk_poll` of ``msgs``, whose values are ``values`` (read once)."""
    return None not in values and _plain_chunk_headers(read_all(msgs, "headers"))


def _plain_chunk_headers(headers: list[Any]) -> bool:
    """True when every record's first header is the current chunk schema (or it has
    none): the header the per-record path would find and accept."""
    if headers.count(_WORKER_CHUNK_HEADERS) == len(headers):
        return True  # what a worker writes, compared in C: the chunk schema comes first
    try:
        firsts = [h[0] if h else _NO_HEADERS for h in headers]
    except (KeyError, IndexError, TypeError):
        return False
    return firsts.count(_CHUNK_HEADER) + firsts.count(_NO_HEADERS) == len(firsts)


def _column_keeps(f: Field, column: list[Any]) -> bool:
    """Every value of ``column`` keeps ``f``'s rules (as :meth:`Field.check` checks them,
    with no value null)."""
    if not f.checked:
        return True
    kind = _PY_TYPES.get(f.type)
    if kind is None or set(map(type, column)) != {kind}:
        return False
    if f.min_length is not None and min(map(len, column)) < f.min_length:
        return False
    if f.max_length is not None and max(map(len, column)) > f.max_length:
        return False
    return f.minimum is None or min(column) >= f.minimum


def _original_fields(letter: DeadLetter) -> dict[str, Any]:
    """The original record's value as a JSON object, or {}."""
    if letter.value is None:
        return {}
    try:
        obj = json.loads(letter.value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _original_run_id(letter: DeadLetter) -> str | None:
    """The run the original record named, when it is a JSON object with a string run_id."""
    if letter.value is None:
        return None
    try:
        obj = json.loads(letter.value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    run_id = obj.get("run_id") if isinstance(obj, dict) else None
    return run_id if isinstance(run_id, str) else None
