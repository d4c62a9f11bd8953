"""When a :class:`~airflow_dbqueue.triggers.dbqueue.DbQueueTrigger` fires, from what its readiness
checks find."""

from __future__ import annotations


class Firing:
    """When a trigger fires, from what each readiness check finds.

    It fires when at least ``threshold`` messages are ready and the head (the message a pop takes first)
    is not the one it last fired for. With ``max_wait``, it also fires when at least ``floor`` messages
    have been ready for ``max_wait`` seconds since it first saw them or since it last fired: a batch
    that stays below the threshold is flushed, and a queue whose triggered run failed before it
    claimed anything (so its head never moved) fires again instead of stalling.
    """

    def __init__(
        self, floor: int, threshold: int, max_wait: float | None, last_head: tuple[int, int] | None
    ) -> None:
        self.floor = floor
        self.threshold = threshold
        self.max_wait = max_wait
        self.last_head = last_head
        self.since: float | None = None

    def step(self, ready: int, head: tuple[int, int] | None, now: float) -> str | None:
        """Return why to fire now (``"ready"`` or ``"max_wait"``), or None."""
        if ready < self.floor or head is None:
            self.last_head = None  # drained below the floor: the next fill fires again
            self.since = None
            return None
        if self.since is None:
            self.since = now
        if ready >= self.threshold and head != self.last_head:
            reason = "ready"
        elif self.max_wait is not None and now - self.since >= self.max_wait:
            reason = "max_wait"
        else:
            return None
        self.last_head, self.since = head, now
        return reason

    def deadline(self) -> float | None:
        """When ``max_wait`` would fire next (monotonic), if the queue stays as it is."""
        if self.max_wait is None or self.since is None:
            return None
        return self.since + self.max_wait
