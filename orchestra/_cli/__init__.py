"""The terminal: the `orchestra` command, its `runs` subcommands, the batch job, the live view, and a run
watched from a terminal (keys, signals). Above the engine; nothing below imports it."""
