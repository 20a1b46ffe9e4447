"""Serving: the vLLM replica, the probe in front of it, the benchmark and the agreement of served answers."""
