"""The queue: jobs and their attempts as a state machine (lifecycle), the claim, leases, heartbeats and the
reaper (queue), and the claims that wait for a job to be queued (waiters)."""
