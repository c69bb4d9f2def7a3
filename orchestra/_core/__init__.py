"""The engine: an orchestrator, its runs, and everything that carries a task from the store to its agent and
back (dispatch, routing, the attempt, recovery, the report). Nothing here is public; `orchestra` re-exports
what users touch."""
