"""The evidence bundle: its files, the operator's attachments, and the tar that `coop report` reads."""

from __future__ import annotations

import uuid

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server.access import audit
from server.access.tokens import Principal
from server.api import spec
from server.protocol import recording
from server.settings import Settings
from server.store import evidencefiles


class EvidenceController(Controller):
    path = "/api/experiments/{experiment_id:uuid}"
    tags = ("evidence",)

    @get("/evidence", operation_id="listEvidence", **spec.read())
    async def listing(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.EvidenceFile]:
        """The bundle's files as the export will contain them (ledger.json besides)."""
        await recording.load(db_session, experiment_id)
        return await evidencefiles.listing(db_session, experiment_id)

    @post("/evidence", operation_id="attachEvidence", **spec.write("operator", body=spec.DOCUMENT))
    async def attach(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.EvidenceAttach],
        db_session: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
    ) -> list[wire.EvidenceFile]:
        """Name blobs the operator uploaded as bundle files (selection.json, the seed's files)."""
        await recording.load(db_session, experiment_id, lock=True)
        await evidencefiles.attach(db_session, experiment_id, data.files)
        await audit.record(
            db_session, principal, "evidence.attach", f"experiment:{experiment_id}", paths=sorted(data.files)
        )
        await db_session.flush()
        return await evidencefiles.listing(db_session, experiment_id)

    @get("/evidence.tar", operation_id="exportEvidence", media_type="application/x-tar", **spec.read())
    async def export(
        self,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Stream:
        """A tar of the evidence bundle plus ledger.json; extract it and run `coop report --home BUNDLE`."""
        await recording.load(db_session, experiment_id)
        members = await evidencefiles.members(db_session, settings, experiment_id)
        return Stream(
            evidencefiles.tar_stream(members),
            media_type="application/x-tar",
            headers={"Content-Disposition": f'attachment; filename="evidence-{experiment_id}.tar"'},
        )
