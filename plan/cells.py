"""A fleet built of cells, for `baton plan` at the 1,000-GPU scale.

A cell is one Baton cluster (one Serve application with its own routers and prefix index: one Helm release);
a fleet of K cells is K copies of it behind a front load balancer. Large fleets are deployed that way (one Ray
cluster per failure domain), and it is what makes such a fleet cheap to simulate:
- a request is routed over its cell's replicas, not the fleet's (routing is O(replicas) per request: the
  prefill router ranks every replica of its pool);
- cells share nothing, so each is its own simulation: on its own core, or only a sample of them when the cells
  are alike (the front balancer spreads the load evenly): the sample's attainment and percentiles stand for
  the fleet's, its rates and replica-seconds times K over the sample.

The front balancer (`split`) keeps a conversation's turns together: a request whose longest prefix sent before
is most of its prompt (a conversation's next turn) goes to the cell that was sent it, unless that cell has been
sent more than `slack` requests' worth of tokens beyond the least-loaded cell; any other request (a new
conversation, under a shared system prompt or not) goes to the least-loaded cell. So a cell's prefix hits are
what a whole fleet's router would find, bar the first request under each shared prompt in each cell.

What this leaves out against one cluster of the fleet's size: a request cannot be routed to, or pull its prefix
from, another cell, and each cell's pools autoscale on their own. docs/benchmarks.md measures the difference.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

from cluster.config import ClusterConfig
from plan.cost import Cost
from plan.sim import SimRequest, Tally, run_tally

T = TypeVar("T")
MEMORY = 1 << 20      # blocks the balancer remembers (twice: this generation and the last)
SLACK = 4.0          # a turn follows its conversation's cell unless it is this many mean requests above the least


def split(items: Iterable[T], cells: int, keep: int | None = None, slack: float = SLACK,
          blocks: Callable[[T], list] = lambda r: r.hashes,
          size: Callable[[T], int] = lambda r: r.prompt + r.output) -> list[list[T]]:
    """The front balancer's answer for each request, in arrival order (simulator requests by default; `blocks` and
    `size` read other items, such as a trace's rows with their hash ids): the requests of the first `keep` cells
    (default all). Every item passes through the balance; only those cells' are kept, so a sample of a day's
    cells needs a sample's memory."""
    keep = cells if keep is None else keep
    out: list[list[T]] = [[] for _ in range(keep)]
    if cells <= 1:
        out[0] = list(items)
        return out
    held: dict[Any, int] = {}             # block -> the cells sent a prompt with it, as bits: the recent blocks
    old: dict[Any, int] = {}              # the generation before (a day's blocks would not fit in memory)
    work = [0] * cells                    # tokens (prompt and output) sent to each cell
    total = 0
    for n, r in enumerate(items):
        hashes = blocks(r)
        mask = depth = 0
        for h in hashes:                  # the cells sent its longest prefix
            m = held.get(h)
            if m is None:
                m = old.get(h)
                if m is None:
                    break
            mask, depth = m, depth + 1
        if 2 * depth < len(hashes):       # not most of its prompt: a new conversation (under a shared prompt)
            mask = 0
        least = min(range(cells), key=work.__getitem__)
        cell = least
        if mask and not mask >> least & 1:
            best = min((c for c in range(cells) if mask >> c & 1), key=work.__getitem__)
            if work[best] - work[least] <= slack * total / n:
                cell = best
        if cell < keep:
            out[cell].append(r)
        k = size(r)
        work[cell] += k
        total += k
        bit = 1 << cell
        for h in hashes:
            m = held.get(h)
            held[h] = (old.get(h, 0) if m is None else m) | bit
        if len(held) > MEMORY:
            old, held = held, {}
    return out


def fleet_summary(t: Tally, cells: int, simulated: int, slo: tuple[float, float] | None) -> dict[str, Any]:
    """The fleet's summary from the tally of the cells simulated (Tally.merge of all `cells` of them, or of a
    sample of `simulated`): attainment and percentiles over the sample's requests, rates and replica-seconds
    scaled to the fleet."""
    scale = cells / simulated
    out = t.summary(slo, scale)
    out["timeline"] = [{k: v if k == "t" or scale == 1 else v * scale for k, v in x.items()} for x in t.timeline]
    out.update(cells=cells, cells_simulated=simulated)
    return out


def simulate_fleet(config: ClusterConfig, cost: Cost, parts: list[list[SimRequest]], cells: int,
                   slo: tuple[float, float] | None = None, **kw: Any) -> dict[str, Any]:
    """`cells` copies of `config`, of which the cells whose requests `parts` holds are simulated (split's
    answer, all of it or its first few), one after the other: the fleet's summary."""
    return fleet_summary(Tally.merge([run_tally(config, cost, p, **kw) for p in parts]), cells, len(parts), slo)
