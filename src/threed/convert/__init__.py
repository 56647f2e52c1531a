"""HF <-> threed checkpoint conversion."""
