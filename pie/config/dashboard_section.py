"""The [dashboard] section: who may read the live dashboard's data (every user's inferlets and
events) and how much its live tails may hold (docs/observability.md#dashboard)."""

from __future__ import annotations

from attrs import field, frozen

from pie.config.checks import at_least, positive


@frozen(kw_only=True)
class DashboardConfig:
    enabled: bool = True
    """Serve the dashboard at /dashboard on the HTTP port ([http] port)."""
    operators: tuple[str, ...] = ()
    """Users who may read its data when the server requires authentication; empty: nobody."""
    max_tails: int = field(default=8, validator=at_least(1))
    """Live tails of the event log open at once, all users together; more are answered 429."""
    max_tails_per_user: int = field(default=2, validator=at_least(1))
    """Live tails one user may have open at once; more are answered 429."""
    tail_buffer: int = field(default=1024, validator=at_least(1))
    """Events queued for one tail; while its reader is that far behind, newer ones are dropped
    (and counted), so a slow reader never slows the engine."""
    tail_backlog: int = field(default=256, validator=at_least(0))
    """Recent events kept so that a new tail starts with those its filter matches."""
    timeline_passes: int = field(default=256, validator=at_least(1))
    """Forward passes kept per model for the pass timeline."""
    refresh_seconds: float = field(default=0.5, validator=positive)
    """The state is computed at most this often, however many ask for it."""
