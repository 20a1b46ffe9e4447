"""The report: recomputed from the bundle alone, its typed model, its figures and its pages."""
