"""The fast path, applied to a built model and never imported by it: its plan (``plan.py``)."""
