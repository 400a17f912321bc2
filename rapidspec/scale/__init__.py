"""Scaling out on Ray: everything that spans processes or machines, and nothing else.

* :mod:`.connect`: connect to a Ray cluster or start a local instance, with one-line errors.
* :mod:`.replicas`: ``rapidspec serve --replicas N`` on Ray Serve (session affinity by
  :data:`SESSION_HEADER`, which :mod:`.affinity` sets in the proxy for requests without it);
  :mod:`.router`: the proxy's request router (a conversation waits for its replica while its line is short);
  :mod:`.fleet`: the board the replicas report their health and metrics to;
  :mod:`.proxy_errors`: the proxy's own errors in OpenAI's schema (and the end of a stream cut by a dying replica).
* :mod:`.eval_workers`: ``rapidspec eval --ray``: actors that answer items with
  engines of their own.

Every part takes a :class:`rapidspec.models.spec.ModelSpec` (what to load) and
never imports the command line. Importing this package loads nothing heavy: the
load client of ``rapidspec bench serve`` reads :data:`SESSION_HEADER` from it.
"""

#: The header whose value keeps a conversation on one replica (Ray Serve's default session-id header,
#: ``RAY_SERVE_SESSION_ID_HEADER_KEY``).
SESSION_HEADER = "x-session-id"
