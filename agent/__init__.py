"""The worker on each GPU host; it imports ``experiment``, never ``server``."""
