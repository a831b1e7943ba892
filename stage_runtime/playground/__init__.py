"""The playground: a page at ``/`` (and ``/playground``) to try a stage in the browser (docs/playground.md).

Plain HTML, CSS and ES modules shipped in ``static/`` — no build step, nothing fetched from the network —
over the stage's public APIs only (``/v1/models``, ``/v1/loras``, ``/v1/images/*`` with ``stream: true``,
``/v1/videos``, ``/v1/abort``): the page has no endpoint of its own. ``route.add_routes`` serves the files with a
strict Content-Security-Policy; ``server.playground: false`` (``serve --no-playground``, the CRD's
``spec.playground: false``) leaves the routes out.
"""
