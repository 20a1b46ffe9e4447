"""The experiment's foundations: canonical bytes, errors, the plan, the bundle layout, progress events, the ledger and
the tasks."""
