"""Database tables and migrations (DESIGN §3) and Kafka record formats (DESIGN §2)."""
