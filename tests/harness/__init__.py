"""What test files share (no test file imports another; ``tests/test_suite_layout.py``).

- ``http``: a raw HTTP/1.1 client (``connect``, ``req``, ``Response``) and the checks
  most tests end with (``quiet``, ``assert_error``, ``still_serves``).
- ``backends``: hand-written recording backends (``Backend``, ``Seen``, ``echo``).
- ``routers``: the router's test config (``router_config``, ``FAST``, ``FAST_HEALTH``)
  and the types of the conftest fixtures.
- ``processes``: ``prefix-router serve`` as a real process.
- ``control``: ``FakeControl``, an in-memory control interface for admin API tests.
- ``http_model``: the reference model of one client connection (pure code).
- ``etcd``: a real etcd server on 127.0.0.1 (start, kill, restart on its data).
- ``fakek8s``: a fake Kubernetes API server serving EndpointSlices by list and watch.
- ``discovery``: waiting for a discovery ``Reconciler`` and reading the fleet.
- ``dockerfile``: the Dockerfile and .dockerignore, read statically.
- ``fallback``: the saturated fallback's answer, from ``hashring.bounded``'s contract.
"""
