"""The audit log: every write through the API leaves one row naming who did what to which thing."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from server.access.tokens import Principal

# One Core INSERT per row, in the request's transaction: a write's audit row makes no ORM object to flush.
_INSERT = insert(models.AuditLog.metadata.tables["audit_log"])


async def record(session: AsyncSession, principal: Principal, action: str, target: str, **detail: Any) -> None:
    values = {
        "token_id": principal.token_id,
        "actor": f"{principal.role}:{principal.name}",
        "action": action,
        "target": target,
        "detail": detail,
    }
    await session.execute(_INSERT, values)
