"""The HTTP gateway: authenticate, rate-limit/admit, persist, publish (docs/design.md §1, §9).

    app.create_app(settings)                the ASGI app
    bootstrap.build_components(...)         every collaborator, built once
    server.serve(settings)                  uvicorn in the foreground, graceful on SIGTERM

Importing this package imports nothing else, so the command line (``cli/``) loads
no server code.

Modules: ``app`` (routes + middleware), ``bootstrap`` (composition root),
``dependencies`` (FastAPI ``Depends``), ``routes`` (HTTP), ``intake`` (request
checks), ``auth``, ``ratelimit``, ``admission`` (persist + publish), ``store``
(SQL), ``sse`` (the events endpoint), ``livefeed`` (chunk-topic tail),
``eventstream`` (SSE wire), ``publisher`` (producer), ``sweeper``, ``exceptions``
(domain errors), ``errors`` (HTTP errors and the mapping), ``models``, ``server``.
"""
