"""The per-test namespace fixtures of tests/integration, shared with the e2e tests."""

from tests.integration.conftest import database, env, kafka_topics, settings

__all__ = ["database", "env", "kafka_topics", "settings"]
