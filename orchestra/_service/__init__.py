"""The service: orchestra's runs over HTTP (FastAPI and uvicorn, the `service` extra).

`orchestra.service.create_app` is the public entry; ``orchestra serve`` runs it under uvicorn.
By concept: `_app.py` the app factory and its lifespan, `_state.py` what the app holds while it
serves (the orchestrator, its store, the runs it started), `_auth.py` bearer tokens and roles as a
FastAPI dependency, `_tokens.py` the tokens kept hashed in the store's database, `_models.py` the
JSON of requests and answers, `_errors.py` the refusals and their JSON, `_runs.py` the runs
routes, `_events.py` the journal as Server-Sent Events, `_tasks.py` one task without a run to
manage, `_dashboard.py` the dashboard's page (``static/``).
"""
