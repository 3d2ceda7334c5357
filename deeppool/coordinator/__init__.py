"""The coordinator: a service users submit foreground and background jobs to.

A REST API (:mod:`~deeppool.coordinator.app`, FastAPI) over embedded SQLite
(:mod:`~deeppool.coordinator.store`): jobs with a state machine whose moves are
compare-and-swap writes recorded in an append-only event log, idempotent
submissions and hashed bearer tokens. A Python client
(:mod:`~deeppool.coordinator.client`) and the CLI over it. See
``docs/coordinator.md``.
"""
