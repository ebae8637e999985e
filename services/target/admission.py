"""Who may open a session on the target (the gateway's Admission is its counterpart there):
the KV pool's fair shares per tenant, and the latency budget.

- Fair shares: once only the last `reserve` of the pool's slots are free, a tenant holding its
  fair share (the slots over the tenants with open sessions, plus one) is refused, so one tenant
  that fills the pool (streams whose clients stopped reading, say) leaves room for another.
- Latency budget: at most the sessions whose shared forward the start-up surface prices within
  budget times a one-token forward, and none while the open sessions' time per token is over
  that (a reading older than TOKEN_TIME_FRESH_S is not used: sessions that stopped asking must
  not lock the service).
A refusal is Overloaded: RESOURCE_EXHAUSTED, the gateway's 503 with Retry-After.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from specd.cost_model import TARGET, CostModel
from specd.errors import Overloaded

TOKEN_TIME_FRESH_S = 1.0  # the latency budget reads the time per token only this recent
FAIR_SHARE_RESERVE = 0.125  # of the KV slots, kept for tenants below their fair share


class TargetAdmission:
    def __init__(self, pool: Callable[[], object], batch_seconds: list[float], one_token_s: float,
                 latency_budget: float = 0.0, fair_share_reserve: float = FAIR_SHARE_RESERVE,
                 costs: CostModel | None = None):
        """pool: the target's KV pool now (None: no slots to share); batch_seconds: the start-up
        surface (B sessions x 1 token); one_token_s: a one-session, one-token forward's seconds;
        latency_budget: 0 for none; costs: the target's cost model, where it follows token_time
        (None: one of its own)."""
        self.costs = costs or CostModel(TARGET)
        self.pool, self.reserve = pool, fair_share_reserve
        self.latency_budget, self.one_token_s = latency_budget, one_token_s
        self.max_sessions = sessions_within_budget(batch_seconds, latency_budget) if latency_budget else None
        self.token_time_at = 0.0  # when token_time was last observed

    def admit(self, tenant: str, open_tenants: list[str]) -> None:
        """Overloaded where a new session of `tenant` is refused; open_tenants: the tenant of
        each open session."""
        pool = self.pool()
        if pool is not None:
            refusal = fair_share(tenant, open_tenants, pool.num_slots - pool.in_use(), pool.num_slots, self.reserve)
            if refusal:
                raise Overloaded(refusal)
        if not self.latency_budget or not open_tenants:
            return
        if len(open_tenants) >= self.max_sessions:
            raise Overloaded(f"serving {len(open_tenants)} sessions, the most within its latency budget")
        budget = self.latency_budget * self.one_token_s
        fresh = time.perf_counter() - self.token_time_at < TOKEN_TIME_FRESH_S  # idle sessions report nothing
        token_time = self.costs.value("token_time")
        if fresh and token_time > budget:
            raise Overloaded(f"serving {len(open_tenants)} sessions at {1e3 * token_time:.0f} ms a "
                             f"token, over its latency budget of {1e3 * budget:.0f} ms")

    def observe_reply(self, seconds_per_token: float) -> None:
        """A session's time since its last reply, per token this one emitted."""
        self.costs.observe("token_time", seconds_per_token)
        self.token_time_at = time.perf_counter()


def fair_share(tenant: str, held_by: list[str], free: int, slots: int, reserve: float) -> str:
    """Why a new session of `tenant` is refused ("": it is not) where the open sessions belong
    to held_by and `free` of `slots` are free: the last ceil(reserve * slots) free slots go
    only to a tenant holding less than a fair share, the slots over the tenants open plus one.
    The empty tenant ("": no tenant named, an open gateway's requests) is never refused here,
    and its sessions count as one tenant's."""
    kept = math.ceil(reserve * slots)
    if not tenant or not kept or free > kept or free <= 0:
        return ""
    held = held_by.count(tenant)
    fair = math.ceil(slots / (len(set(held_by)) + 1))  # a share kept for one more tenant
    if held < fair:
        return ""
    return (f"{free} of {slots} KV slots are free, kept for other tenants: this one holds {held}, "
            f"its fair share")


def sessions_within_budget(batch_seconds: list[float], budget: float) -> int:
    """The most sessions whose shared forward costs at most `budget` times a one-session forward
    (batch_seconds[B - 1]: B sessions x 1 token, measured at start-up); at least 1."""
    if not batch_seconds or batch_seconds[0] <= 0:
        return 1
    return max([b for b, t in enumerate(batch_seconds, 1) if t <= budget * batch_seconds[0]], default=1)
