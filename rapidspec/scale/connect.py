"""Ray for ``serve --replicas`` and ``eval --ray``: imported with a clear error when the extra is missing, and
connected to a cluster or a local instance started here."""

from __future__ import annotations

import logging

from rapidspec.errors import RapidspecError


def connect_ray(address: str | None, flag: str, **init_options):
    """The ``ray`` module, initialized: connected to the cluster at ``address``, or to a local instance started here
    (None); a process where Ray already runs keeps it. ``flag`` names the option in the errors."""
    try:
        import ray
    except ImportError:
        raise RapidspecError(f"{flag} needs the ray extra: pip install 'rapidspec[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False if address is None else None,
                     logging_level=logging.WARNING, **init_options)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise RapidspecError(f"cannot connect to Ray at {address or 'a local instance'}: {err}") from None
    return ray
