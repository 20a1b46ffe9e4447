"""The audit log: every write through the API leaves one row naming who did what to which thing."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from server.access.tokens import Principal


def record(session: AsyncSession, principal: Principal, action: str, target: str, **detail: Any) -> None:
    session.add(
        models.AuditLog(
            token_id=principal.token_id,
            actor=f"{principal.role}:{principal.name}",
            action=action,
            target=target,
            detail=detail,
        )
    )
