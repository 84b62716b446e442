from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from koda_runtime.gateway.errors import (
    BadRequest,
    InvalidField,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from koda_runtime.gateway.intake import (
    MAX_DEPTH,
    check_content_type,
    check_idempotency_key,
    decode_json,
    parse_run_request,
    read_body,
)


def nested(levels: int) -> dict:
    """A body whose total nesting (the body object included) is ``levels``."""
    inner: dict | list = {}
    for _ in range(levels - 2):
        inner = {"a": inner}
    return {"input": inner}


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON;charset=UTF8",
        "application/vnd.koda+json",
    ],
)
def test_json_content_types_are_accepted(content_type: str) -> None:
    check_content_type(content_type)


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "application/json; charset=latin-1",
    ],
)
def test_other_content_types_are_415(content_type: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as info:
        check_content_type(content_type)
    assert info.value.status == 415 and info.value.field == "Content-Type"


def test_idempotency_key_rules() -> None:
    assert check_idempotency_key([]) is None
    assert check_idempotency_key(["order-42 ~!"]) == "order-42 ~!"
    assert check_idempotency_key(["k" * 200]) == "k" * 200
    for bad in (["k" * 201], ["a\r\nb"], ["a\nb"], ["a\tb"], ["\x7f"], ["é"], [""], ["a", "b"]):
        with pytest.raises(BadRequest) as info:
            check_idempotency_key(bad)
        assert info.value.field == "Idempotency-Key"
        assert info.value.code == "invalid_header"
        assert "Idempotency-Key" in info.value.message


async def test_read_body_refuses_a_large_content_length_before_reading() -> None:
    async def never() -> AsyncIterator[bytes]:
        raise AssertionError("the body must not be read")
        yield b""

    with pytest.raises(PayloadTooLarge):
        await read_body("1025", never(), 1024)


async def test_read_body_counts_streamed_bytes() -> None:
    assert await read_body(None, chunks(b"a" * 512, b"b" * 512), 1024) == b"a" * 512 + b"b" * 512
    with pytest.raises(PayloadTooLarge):
        await read_body(None, chunks(b"a" * 512, b"b" * 513), 1024)
    # a lying Content-Length does not help either
    with pytest.raises(PayloadTooLarge):
        await read_body("10", chunks(b"a" * 2048), 1024)


async def test_read_body_refuses_a_bad_content_length() -> None:
    with pytest.raises(BadRequest) as info:
        await read_body("-1", chunks(b"{}"), 1024)
    assert info.value.field == "Content-Length"


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"", "invalid_json", "empty"),
        (b"   ", "invalid_json", "empty"),
        (b"{", "invalid_json", "line 1 column 2"),
        (b'{"input": NaN}', "invalid_json", "NaN"),
        (b'{"input": 1e999}', "invalid_json", "out of range"),
        (b'{"input": "\xff"}', "invalid_utf8", "UTF-8"),
        (b'{"input": "\xc3"}', "invalid_utf8", "byte 11"),
    ],
)
def test_decode_json_names_the_problem(body: bytes, code: str, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_json(body)
    assert info.value.code == code
    assert words in info.value.message


def test_decode_json_refuses_pathological_nesting_without_crashing() -> None:
    with pytest.raises(InvalidField) as info:
        decode_json(b"[" * 200_000 + b"]" * 200_000)
    assert info.value.status == 422


def test_string_input_becomes_a_text_object() -> None:
    req = parse_run_request({"input": "hello"})
    assert req.input == {"text": "hello"}
    assert req.session_id is None and req.metadata is None and req.client_message_id is None


def test_all_fields() -> None:
    req = parse_run_request(
        {
            "input": {"q": [1, 2]},
            "session_id": "s-1",
            "metadata": {"m": 1},
            "client_message_id": "c1",
        }
    )
    assert (req.input, req.session_id, req.metadata, req.client_message_id) == (
        {"q": [1, 2]},
        "s-1",
        {"m": 1},
        "c1",
    )
    nulls = parse_run_request({"input": "x", "session_id": None, "metadata": None})
    assert nulls.session_id is None and nulls.metadata is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "input"),
        ({"input": None}, "input"),
        ({"input": 3}, "input"),
        ({"input": ["a"]}, "input"),
        ({"input": True}, "input"),
        ({"input": "  "}, "input"),
        ({"input": "x", "session_id": 5}, "session_id"),
        ({"input": "x", "session_id": ""}, "session_id"),
        ({"input": "x", "session_id": "a b"}, "session_id"),
        ({"input": "x", "session_id": "s" * 129}, "session_id"),
        ({"input": "x", "metadata": "m"}, "metadata"),
        ({"input": "x", "metadata": [1]}, "metadata"),
        ({"input": "x", "client_message_id": 1}, "client_message_id"),
        ({"input": "x", "client_message_id": "c" * 201}, "client_message_id"),
        ({"input": "x", "sesion_id": "s"}, "sesion_id"),
        ({"input": "nul\x00"}, "input"),
        ({"input": {"k\x00": 1}}, "input"),
        ({"input": "x", "metadata": {"s": "\ud800"}}, "metadata"),
        (["input"], "body"),
        ("input", "body"),
    ],
)
def test_invalid_fields_are_named(body: object, field: str) -> None:
    with pytest.raises(InvalidField) as info:
        parse_run_request(body)
    assert info.value.status == 422
    assert info.value.code == "invalid_field"
    assert info.value.field == field


def test_nesting_limit_is_32_levels_counting_the_body() -> None:
    ok = nested(MAX_DEPTH)
    parse_run_request(decode_json(json.dumps(ok).encode()))
    with pytest.raises(InvalidField) as info:
        parse_run_request(decode_json(json.dumps(nested(MAX_DEPTH + 1)).encode()))
    assert info.value.field == "input"
    assert "32 levels" in info.value.message
    deep_list: list = []
    for _ in range(MAX_DEPTH):
        deep_list = [deep_list]
    with pytest.raises(InvalidField) as info:
        parse_run_request({"input": "x", "metadata": {"l": deep_list}})
    assert info.value.field == "metadata"


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=3), children, max_size=3)
        ),
        max_leaves=20,
    )
)
def test_any_json_input_object_is_accepted_or_refused_with_a_field(value: object) -> None:
    body = {"input": {"v": value}}
    try:
        req = parse_run_request(decode_json(json.dumps(body).encode()))
    except InvalidField as exc:
        assert exc.field == "input"
    else:
        assert req.input == {"v": value}
