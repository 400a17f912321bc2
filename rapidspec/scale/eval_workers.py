"""``rapidspec eval --ray``: the items answered by Ray actors, each with an engine of its own.

The driver (``rapidspec eval``) keeps the results file, the judge and the
progress bar; each of ``workers`` actors loads the models once and answers
what it is given with :class:`~rapidspec.evaluation.item_runner.ItemRunner`,
so a record is the same as a local run's (its timing aside). Work goes out
one document at a time (every question and run variant about it together, so
the actor's prefix cache serves them) through Ray's ``ActorPool``, to
whichever actor is free. A local Ray instance is started when no address is
given (``ray start --head`` makes a cluster; every node needs the models:
``rapidspec models install`` or the same paths).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import EvalItem
from rapidspec.evaluation.item_runner import ItemRunner, RunOptions
from rapidspec.scale.connect import connect_ray

DEFAULT_WORKER_RESOURCES = {"num_cpus": 1}


class EvalActor:
    """One engine on a Ray worker process: loads the models of ``spec`` (an EngineSpec) once, and builds its
    engine from the whole spec (every drafter option, retrieval) for each run."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.target, self.drafter = spec.models.load()
        self.runner: ItemRunner | None = None

    def max_context(self) -> int:
        return self.target.max_context

    def synthetic_items(self, options: dict) -> list[EvalItem]:
        """The synthetic needle items (their lengths are counted with the target's tokenizer)."""
        from rapidspec.evaluation.datasets import load_items

        return load_items(None, "synthetic", synthetic_options=options | {"tokenizer": self.target.tokenizer})

    def prepare(self, options: RunOptions) -> dict:
        """Make the engine's runner for ``options``; the run's configuration (the results file's identity)."""
        self.runner = ItemRunner(self.spec, self.target, self.drafter, options)
        return self.runner.config

    def run(self, unit: list[tuple[EvalItem, object]]) -> list[tuple[EvalItem, dict]]:
        return list(self.runner.run_all(unit))


class RayWorkers:
    """``workers`` :class:`EvalActor` on the Ray cluster at ``address`` (None: a local instance started here)."""

    def __init__(self, spec, workers: int, address: str | None = None,
                 resources: dict | None = None) -> None:
        if workers < 1:
            raise RapidspecError(f"--workers must be >= 1, got {workers}")
        self.spec, self.workers, self.address = spec, workers, address
        self.resources = dict(DEFAULT_WORKER_RESOURCES if resources is None else resources)
        self._actors: list = []
        self.config: dict = {}

    def connect(self) -> "RayWorkers":
        """Connect to Ray (or start a local instance) and start the actors; each loads the models."""
        ray = connect_ray(self.address, "--ray", log_to_driver=False)  # the driver's progress bar stays readable
        try:
            actor = ray.remote(**self.resources)(EvalActor)
        except (TypeError, ValueError) as err:
            raise RapidspecError(f"--worker-resources: {err}") from None
        self._actors = [actor.remote(self.spec) for _ in range(self.workers)]
        return self

    def ask_one(self, method: str, *args):
        """What the first actor's ``method`` returns (all actors load the same models)."""
        return _get(getattr(self._actors[0], method).remote(*args))

    def start(self, options: RunOptions) -> "RayWorkers":
        """Give every actor its runner for ``options``; their common configuration becomes ``config``."""
        configs = _get([actor.prepare.remote(options) for actor in self._actors])
        if any(c != configs[0] for c in configs[1:]):
            raise RapidspecError("the Ray workers loaded the models differently (device, dtype or backend); "
                                 "give them the same resources or name --device")
        self.config = configs[0]
        return self

    def run_all(self, pending: Iterable[tuple[EvalItem, object]]) -> Iterator[tuple[EvalItem, dict]]:
        """(item, record) for each pair, a document's worth at a time, in the order the actors finish."""
        from ray.util import ActorPool

        units: dict[str, list] = {}
        for item, variant in pending:
            units.setdefault(item.document if not item.messages else repr(item.messages[:1]), []).append((item, variant))
        pool = ActorPool(self._actors)
        results = pool.map_unordered(lambda actor, unit: actor.run.remote(unit), list(units.values()))
        while True:
            try:
                done = _get(results, next)
            except StopIteration:
                return
            yield from done


def _get(refs, fetch=None):
    """``ray.get(refs)`` (or ``fetch(refs)``) with an actor's failure as a RapidspecError naming its cause."""
    import ray

    try:
        return ray.get(refs) if fetch is None else fetch(refs)
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else err
        if isinstance(cause, RapidspecError):
            raise RapidspecError(str(cause)) from None
        raise RapidspecError(f"a Ray worker failed: {cause!r}") from None
    except ray.exceptions.RayActorError as err:
        raise RapidspecError(f"a Ray worker died: {err}") from None

