"""The SQLite store: runs kept in one database file on one machine. `SQLiteStore` is in `_store.py`,
which lists the other modules by concept."""
