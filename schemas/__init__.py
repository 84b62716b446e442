"""Database tables and migrations, and Kafka record formats (docs/design.md §3, §2)."""
