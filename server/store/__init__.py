"""What the coordinator keeps: blobs by content, the evidence bundle's files, the append-only ledger of
commitments, answers and measurements with their listings, idempotent uploads, and rows as wire records."""
