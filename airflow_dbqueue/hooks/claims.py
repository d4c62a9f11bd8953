"""Claims: what the pop operator and the claiming sensor hand to the next task through XCom.

A claim is ``{"queue_name", "semantics", "count", "receipts", "messages"}``, and ``"group"`` when popped
for a consumer group of a ring (whose receipts are that group's). ``receipts`` are ``[id, delivery]``
pairs of leased messages (at-least-once; empty for at-most-once). ``messages`` holds the messages with
their payloads, JSON-safe, when there are at most ``xcom_max_messages`` of them, else ``None``: a larger
leased batch stays claimed in the database, where the next task reads it by its receipts.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine import ConfigurationError, Message, PayloadType, Semantics

XCOM_MAX_MESSAGES = 100
"""The most messages a claim carries inline, payloads and all, unless the task names another number."""


def message_to_xcom(msg: Message, payload_type: PayloadType) -> dict[str, Any]:
    """Return a JSON-safe dict of a message (bytes payloads as base64, flagged by ``payload_encoding``)."""
    out: dict[str, Any] = {
        "id": msg.id,
        "attempts": msg.attempts,
        "delivery": msg.delivery,
        "priority": msg.priority,
        "enqueued_at": msg.enqueued_at.isoformat(),
        "payload": msg.payload,
    }
    if payload_type is PayloadType.BYTES:
        out["payload"] = base64.b64encode(msg.payload).decode("ascii")
        out["payload_encoding"] = "base64"
    return out


def receipt(r: Sequence[int]) -> tuple[int, int]:
    """A receipt ``[id, delivery]`` (as XCom carries it) as the engine's pair, or ConfigurationError."""
    try:
        mid, delivery = r
    except (TypeError, ValueError):
        raise ConfigurationError(f"a receipt is a pair [id, delivery], got {r!r}") from None
    return mid, delivery


def check_claimable(sem: Semantics, n: int, xcom_max_messages: int) -> None:
    """Refuse, before anything is popped, a pop whose messages a claim cannot hand on."""
    if sem is Semantics.EXACTLY_ONCE:
        raise ConfigurationError(
            "exactly-once needs the processing to run in the pop's transaction, which XCom cannot "
            "carry: pop with DbQueueHook.transaction() inside the task that writes the results"
        )
    if sem is Semantics.AT_MOST_ONCE and n > xcom_max_messages:
        raise ConfigurationError(
            f"an at-most-once pop of up to {n} messages cannot hand them on: popped messages are "
            f"finished, and more than xcom_max_messages={xcom_max_messages} payloads would flood XCom; "
            "use at-least-once (the batch stays claimed) or a smaller batch"
        )


def make_claim(
    queue_name: str,
    sem: Semantics,
    msgs: Sequence[Message],
    payload_type: PayloadType,
    *,
    xcom_max_messages: int,
    group: str | None,
) -> dict[str, Any]:
    """The claim of the messages ``msgs`` popped from ``queue_name`` with ``sem``."""
    leased = sem is Semantics.AT_LEAST_ONCE
    inline = len(msgs) <= xcom_max_messages
    claim = {
        "queue_name": queue_name,
        "semantics": sem.value,
        "count": len(msgs),
        "receipts": [list(m.receipt) for m in msgs] if leased else [],
        "messages": [message_to_xcom(m, payload_type) for m in msgs] if inline else None,
    }
    if group is not None:
        claim["group"] = group
    return claim
