"""koda: a Kafka runtime for long-running, streamed, per-user-ordered jobs."""

__version__ = "0.1.0"

__all__ = ["__version__"]
