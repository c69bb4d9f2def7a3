"""A worker's side of a store it reaches through the service (``orchestra worker --url``): the
worker's `Backend` over HTTP (`_worker.py`) and the JSON both ends speak (`_wire.py`)."""
