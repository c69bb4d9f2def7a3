"""orchestra."""
