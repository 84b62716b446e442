"""The run lifecycle: pure Python, no Kafka, Faust or SQLAlchemy imports.

State machine, chunk kinds and seq rules, retry policy, idempotency keys.
"""
