"""The topic catalogue of docs/design.md §2 and the admin commands that apply and check it."""

from koda_runtime.topics.admin import Drift, apply_topics, check_topics
from koda_runtime.topics.catalogue import TopicSpec, catalogue, partition_for_key

__all__ = ["Drift", "TopicSpec", "apply_topics", "catalogue", "check_topics", "partition_for_key"]
