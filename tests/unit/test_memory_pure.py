"""Memory and tool-call pure parts: chunking, the demo rule, fragment assembly, args."""

from __future__ import annotations

import pytest

from koda_runtime.errors import HandlerError
from koda_runtime.processors.handlers.tools import ToolCallAssembler
from koda_runtime.processors.memory.chunking import CHUNK_CHARS, OVERLAP_CHARS, chunk, content_hash
from koda_runtime.processors.memory.distil import demo_statements
from koda_runtime.processors.memory.tool import ToolArgumentError, parse_args


def test_chunks_are_whole_sentences_of_about_400_chars_with_80_of_overlap() -> None:
    sentences = [
        f"Sentence number {i} says something about the user and their day." for i in range(30)
    ]
    chunks = chunk(" ".join(sentences))
    assert len(chunks) > 3
    for c in chunks:
        assert len(c) <= CHUNK_CHARS and c.endswith(".")
        assert all(s in sentences for s in [p + "." for p in c[:-1].split(". ")])
    for before, after in zip(chunks, chunks[1:], strict=False):
        last = before.rsplit(". ", 1)[-1]
        assert after.startswith(last) and len(last) <= OVERLAP_CHARS


def test_a_sentence_longer_than_a_chunk_is_cut_at_words() -> None:
    long = " ".join(["word"] * 300) + "."
    assert all(len(c) <= CHUNK_CHARS for c in chunk(long))


def test_dedupe_hash_ignores_case_and_spacing() -> None:
    assert content_hash("I live in  Lisbon.") == content_hash("i live in lisbon.")
    assert content_hash("I live in Lisbon.") != content_hash("I live in Porto.")


def test_the_demo_rule_keeps_first_person_statements_only() -> None:
    text = "My sister lives in Porto. What is my name? The sky is blue. follow me I'm 40!"
    assert demo_statements(text) == ["My sister lives in Porto.", "follow me I'm 40!"]
    assert demo_statements("follow me") == []


def test_fragments_join_by_index_then_by_id() -> None:
    a = ToolCallAssembler()
    a.feed([{"index": 0, "id": "call_a", "function": {"name": "memory_search", "arguments": ""}}])
    a.feed(
        [{"index": 1, "id": "call_b", "function": {"name": "memory_search", "arguments": '{"qu'}}]
    )
    a.feed([{"index": 0, "function": {"arguments": '{"query": "city"}'}}])
    a.feed([{"index": 1, "function": {"arguments": 'ery": "dog"}'}}])
    calls = a.calls()
    assert [(c.id, c.arguments) for c in calls] == [
        ("call_a", '{"query": "city"}'),
        ("call_b", '{"query": "dog"}'),
    ]
    b = ToolCallAssembler()  # a server that sends ids and no index
    b.feed([{"id": "x1", "function": {"name": "memory_search", "arguments": '{"query":'}}])
    b.feed([{"id": "x2", "function": {"name": "memory_search", "arguments": '{"query": "b"}'}}])
    b.feed([{"id": "x1", "function": {"arguments": ' "a"}'}}])
    assert [(c.id, c.arguments) for c in b.calls()] == [
        ("x1", '{"query": "a"}'),
        ("x2", '{"query": "b"}'),
    ]


def test_a_fragment_without_index_or_id_first_is_refused() -> None:
    with pytest.raises(HandlerError, match="neither index nor id"):
        ToolCallAssembler().feed([{"function": {"arguments": "{}"}}])
    nameless = ToolCallAssembler()
    nameless.feed([{"index": 0, "function": {"arguments": "{}"}}])
    with pytest.raises(HandlerError, match="without a function name"):
        nameless.calls()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"query": "x", "limit": 50}', "field 'limit' must be an integer from 1 to 10 (got 50)"),
        ('{"query": "x", "limit": 0}', "field 'limit' must be an integer from 1 to 10 (got 0)"),
        ('{"query": "x", "limit": true}', "field 'limit'"),
        ('{"query": ""}', "field 'query' is required"),
        ('{"query": "x", "user": "alice"}', "has no field 'user'"),
        ("[1]", "must be a JSON object"),
        ('{"query": ', "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "cannot be read (RecursionError)"),
        ('{"query": "x", "limit": ' + "9" * 5000 + "}", "cannot be read (ValueError)"),
    ],
)
def test_bad_arguments_get_an_error_naming_the_field(raw: str, message: str) -> None:
    with pytest.raises(ToolArgumentError, match="example") as caught:
        parse_args(raw)
    assert message in str(caught.value)


def test_limit_defaults_to_five() -> None:
    assert parse_args('{"query": "home city"}').limit == 5


def test_memory_settings_are_read_and_checked() -> None:
    from koda_runtime.errors import ConfigError
    from koda_runtime.settings import Settings

    s = Settings.from_env(
        {
            "APP_ENV": "dev",
            "KODA_MEMORY": "false",
            "KODA_EMBEDDER": "openai",
            "KODA_EMBEDDINGS_MODEL": "emb-x",
            "KODA_MEMORY_AUTO_INJECT": "4",
            "KODA_MAX_TOOL_TURNS": "3",
        }
    )
    assert (s.memory_enabled, s.embedder, s.embeddings_model) == (False, "openai", "emb-x")
    assert (s.memory_auto_inject, s.max_tool_turns) == (4, 3)
    with pytest.raises(ConfigError, match="KODA_EMBEDDER='bert'"):
        Settings.from_env({"APP_ENV": "dev", "KODA_EMBEDDER": "bert"})
    with pytest.raises(ConfigError, match="KODA_MEMORY_AUTO_INJECT=2: 0 .off. or 3 to 5"):
        Settings.from_env({"APP_ENV": "dev", "KODA_MEMORY_AUTO_INJECT": "2"})
    with pytest.raises(ConfigError, match="KODA_MAX_TOOL_TURNS"):
        Settings.from_env({"APP_ENV": "dev", "KODA_MAX_TOOL_TURNS": "0"})


def test_runs_follow_prints_tool_activity(capsys: pytest.CaptureFixture[str]) -> None:
    import json as _json

    from koda_runtime.cli.runs import _Follower
    from koda_runtime.gateway.eventstream import Event

    follower = _Follower(None)
    call = {"call_id": "c0", "name": "memory_search", "arguments": '{"query": "city"}'}
    result = {"call_id": "c0", "name": "memory_search", "result": "No memories matched"}
    for seq, content in enumerate((call, result)):
        data = _json.dumps(
            {"run_id": "r", "seq": seq, "kind": "tool", "content": _json.dumps(content)}
        )
        assert not follower.handle(Event(str(seq), "tool", data))
    err = capsys.readouterr().err
    assert '[tool memory_search({"query": "city"})]' in err
    assert "[tool memory_search -> No memories matched]" in err


def test_subjects_of_first_and_third_person_statements() -> None:
    from koda_runtime.processors.memory.truth import normalise_subject, subject_of

    assert subject_of("I live in Lisbon.") == subject_of("The user has moved to Berlin.") == "home"
    assert subject_of("My sister lives in Porto.") == "sister home"
    assert subject_of("I work as a nurse.") == subject_of("The user is a data engineer.")
    assert subject_of("My favorite color is blue.") == "favourite colour"
    assert subject_of("My wife is very kind.") is None  # a person is no subject
    assert subject_of("I like tea.") is None
    assert normalise_subject("  Partner_Name ") == "partner name"
    assert normalise_subject("   ") is None


def test_words_with_digits_keep_facts_apart() -> None:
    from koda_runtime.processors.memory.truth import is_duplicate, numbers

    assert numbers("My birthday is on the 14th of March.") == numbers("Born on 14 March.")
    assert numbers("I keep note chaos-1.") != numbers("I keep note chaos-2.")
    # A near score alone is not enough when the digits or the subjects differ.
    assert not is_duplicate(0.99, False, None, None, 0.87, same_numbers=False)
    assert not is_duplicate(0.99, False, "home", "sister home", 0.87)
    assert is_duplicate(0.9, False, "home", None, 0.87)
    assert not is_duplicate(0.99, False, None, None, None)  # uncalibrated: text only
    assert is_duplicate(None, True, "a", "b", None)


def test_each_statement_is_its_own_memory_and_backoff_is_capped() -> None:
    from koda_runtime.processors.memory.distil import statement, statements_to_chunks
    from koda_runtime.processors.memory.distiller import BACKOFF_CAP_S, backoff_s

    chunks = statements_to_chunks([statement("I live in Lisbon."), statement("x " * 300)])
    assert chunks[0].text == "I live in Lisbon." and chunks[0].subject == "home"
    assert len(chunks) > 2 and all(len(c.text) <= CHUNK_CHARS for c in chunks)
    assert [backoff_s(t) for t in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert backoff_s(50) == BACKOFF_CAP_S
