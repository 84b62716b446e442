"""The Kafka record formats: what each topic's records hold, on the wire.

``specs`` is the machinery (fields, variants), ``formats`` declares every record,
``codec`` encodes and decodes the run records, and ``events``, ``dead_letters`` and
``heartbeats`` the others. ``json_schemas`` generates the JSON Schemas in ``json/``
from the declarations (``koda schemas write``); the Postgres tables live in ``schemas/``.
"""
