"""The coordinator's Prometheus metrics: counted where things happen (claims answered, leases expired, uploads
refused) and read at scrape time (jobs by state and agents' last contact from the database, the blob store's free
space from its disk), in one registry that
each app owns, so that two apps in one process never share a series."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.states import JobState
from server import models
from server.protocol import kinds

# Claims are answered from a few milliseconds (work was queued) to the long poll's end (up to 600 s).
CLAIM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)


class Metrics:
    """One app's series. The database-read gauges are filled by ``exposition`` just before they are written."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.claim_seconds = Histogram(
            "coop_claim_seconds",
            "Seconds from a claim's arrival to its answer (the long poll included), by whether it got work",
            ["outcome"],
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.lease_expiries = Counter(
            "coop_lease_expiries",
            "Attempts the reaper ended lost because their lease expired",
            registry=self.registry,
        )
        self.uploads_refused = Counter(
            "coop_uploads_refused",
            "Uploads (event batches, results, blobs) answered with a 4xx, by upload and reason",
            ["upload", "reason"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            "coop_jobs", "Jobs by kind and state, read from the database", ["kind", "state"], registry=self.registry
        )
        self.agent_last_contact = Gauge(
            "coop_agent_last_contact_seconds",
            "When each agent last registered or heartbeat, in seconds since the epoch, read from the database",
            ["agent"],
            registry=self.registry,
        )
        self.blob_store_free = Gauge(
            "coop_blob_store_free_bytes",
            "Bytes free on the blob store's disk; an upload that does not fit is answered 507 and kept by its agent",
            registry=self.registry,
        )

    def exposition(
        self,
        jobs: Mapping[tuple[str, str], int],
        agents: Iterable[tuple[str, datetime.datetime]],
        blob_store_free: int,
        accept: str,
    ) -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for (Prometheus' text format by default), and its content type.
        Every kind and state is written, zero included, so that a series does not vanish when its jobs move on."""
        # Nothing awaits between filling the gauges and writing them: two scrapes on the event loop cannot interleave.
        self.jobs.clear()
        for kind in kinds.TABLE:
            for known in JobState:
                self.jobs.labels(kind, known.value).set(0)
        for (kind, state), count in jobs.items():
            self.jobs.labels(kind, state).set(count)
        self.agent_last_contact.clear()
        for name, seen in agents:
            self.agent_last_contact.labels(name).set(seen.timestamp())
        self.blob_store_free.set(blob_store_free)
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


async def jobs_by_state(session: AsyncSession) -> dict[tuple[str, str], int]:
    rows = await session.execute(
        select(models.Job.kind, models.Job.state, func.count()).group_by(models.Job.kind, models.Job.state)
    )
    return {(kind, state): int(count) for kind, state, count in rows}


async def last_contacts(session: AsyncSession) -> list[tuple[str, datetime.datetime]]:
    rows = await session.execute(select(models.Agent.name, models.Agent.last_seen_at).order_by(models.Agent.name))
    return [(name, seen) for name, seen in rows]
