"""The run lifecycle: pure Python, no Kafka, Faust or SQLAlchemy imports.

State machine (states.py), chunk kinds, terminal kinds and seq rules (chunks.py), the
rules of attempts (attempts.py: claim bound, give-up, retry, reset, first output, end
events), retry policy, idempotency keys, the handler protocol, run control and ledger
rules.
"""
