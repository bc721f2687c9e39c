"""NCCL's RAS as an evidence source: its socket protocol and report (``client``), the polls that watch and compare
communicators' progress (``poll``), and what it gives an incident (``incident``)."""
