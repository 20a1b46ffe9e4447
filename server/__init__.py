"""The coordinator (Litestar service); it imports ``experiment``, never ``agent``."""
