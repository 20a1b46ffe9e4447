"""Thin Litestar controllers, one module per resource; logic lives in the services they call."""
