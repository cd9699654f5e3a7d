"""Plans cached on disk, keyed by everything that decides them.

The key hashes the model shape, batch, KV length, the device spec (its calibration
included), the search settings, the Triton and mk versions, and the planner's own source
(so a development checkout never reads a plan an older search made): a change to any of
them is a new plan. Files live in ``$MK_CACHE_DIR/plans`` (default ``~/.cache/mk/plans``) as
the plan's JSON; a file that does not parse is ignored and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from mk.tasks import cache_dir, sources_hash

from .device import DeviceSpec
from .graph import OpGraph
from .search import Plan, own_all_reduces, pick_measured, search

#: Plans ``measure`` mode times: the search's best few.
MEASURE_TOP_K = 4
#: ``measure`` mode also times the best plan under each other queue schedule whose
#: simulated step is within this fraction of its own (the GPU decides between near ties).
MEASURE_SCHEDULE_SLACK = 0.05


def plan_dir() -> Path:
    """Where plans are kept: ``<cache_dir>/plans``."""
    return cache_dir("plans")


def _planner_sources() -> list[Path]:
    """The planner's source and the task modules its cost model reads (tile rules, stream
    rules, shared-memory sizes: mk/tasks, its packages included), so that a change to either
    re-plans."""
    package = Path(__file__).parent.parent
    return sorted([*(package / "planner").glob("*.py"), *(package / "tasks").rglob("*.py")])


@functools.lru_cache(maxsize=1)
def _planner_source_hash() -> str:
    # (Once a process: a plan lookup must not read three dozen files.)
    return sources_hash(_planner_sources())


def plan_key(graph: OpGraph, device: DeviceSpec, workers: int, beam_width: int, measured_top_k: int = 0) -> str:
    import triton

    from mk import __version__

    blob = json.dumps({"graph": graph.to_json(indent=None), "batch": graph.batch, "kv_len": graph.kv_len,
                       "device": device.to_dict(), "workers": workers, "beam": beam_width,
                       "measured_top_k": measured_top_k,
                       "triton": triton.__version__, "mk": __version__,
                       "planner": _planner_source_hash()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def schedule_variants(plan: Plan, slack: float = MEASURE_SCHEDULE_SLACK) -> list[Plan]:
    """``plan`` under each other schedule whose simulated step is within ``slack`` of its own."""
    return [replace(plan, schedule=s, predicted_s=t) for s, t in plan.schedule_s.items()
            if s != plan.schedule and t <= plan.predicted_s * (1 + slack)]


class Ranks(Protocol):
    """What :func:`cached_plan` needs of tensor-parallel ranks that measure together: ``lead``
    (this is rank 0), and two collectives, which every rank calls in the same order."""

    lead: bool

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""

    def share(self, obj):
        """Rank 0's ``obj``, on every rank."""


def cached_plan(graph: OpGraph, device: DeviceSpec, *, workers: int | None = None, beam_width: int = 6,
                progress: bool = False, measure=None, top_k: int = MEASURE_TOP_K,
                ranks: Ranks | None = None) -> tuple[Plan, bool]:
    """The best plan for ``graph`` on ``device``, from the cache when it is there.

    Returns (plan, hit). A miss runs :func:`~mk.planner.search.search` and stores the result.
    With ``measure`` (a function: plan -> measured seconds a step), a miss times the
    search's ``top_k`` plans, the best one under the schedules the simulation finds about
    as fast (:func:`schedule_variants`) and, where it sums over tensor-parallel ranks in
    its projections' tiles, with those sums in tiles of their own
    (:func:`~mk.planner.search.own_all_reduces`), and keeps the fastest
    (:func:`~mk.planner.search.pick_measured`); measured plans are cached apart from
    predicted ones.

    ``ranks`` (tensor-parallel ranks measuring together; ``measure`` then returns the same
    seconds on every rank): the cache counts as a hit only where every rank hits, rank 0
    alone searches, and every rank times rank 0's candidates in its order, so the ranks'
    collectives pair up; where rank 0's search fails, every rank raises.
    """
    measured = measure is not None
    key = plan_key(graph, device, workers, beam_width, top_k if measured else 0)
    path = plan_dir() / f"{key}.json"
    cached = None
    if path.is_file():
        try:
            cached = Plan.from_json(path.read_text())
        except (ValueError, KeyError, TypeError):
            pass  # corrupt or from an older layout: plan again
    if ranks is not None and measured and not ranks.all(cached is not None):
        cached = None
    if cached is not None:
        return cached, True
    if not measured:
        plan = search(graph, device, workers=workers, beam_width=beam_width, top_k=1, progress=progress)[0]
    else:
        def candidates() -> list[Plan]:
            plans = search(graph, device, workers=workers, beam_width=max(beam_width, top_k), top_k=top_k,
                           progress=progress)
            plans += schedule_variants(plans[0])
            own = own_all_reduces(plans[0], graph, device)
            if own is not None and all((own.choices, own.workers) != (p.choices, p.workers) for p in plans):
                plans.append(own)
            return plans

        if ranks is None:
            plans = candidates()
        else:  # rank 0 searches; its candidates, or that its search failed, go to every rank
            plans, failed = None, None
            if ranks.lead:
                try:
                    plans = candidates()
                except Exception as e:
                    failed = e
            shared = ranks.share(f"{type(failed).__name__}: {failed}" if failed else
                                 [p.to_json() for p in plans] if ranks.lead else None)
            if failed is not None:
                raise failed
            if isinstance(shared, str):
                raise RuntimeError(f"planning failed on rank 0: {shared}")
            plans = [Plan.from_json(text) for text in shared]
        plan = pick_measured(plans, measure)[0]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(plan.to_json())
    tmp.replace(path)
    return plan, False
