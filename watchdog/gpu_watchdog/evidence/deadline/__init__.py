"""The job's own deadline: when its collective timeout would end a wait by itself (``sources``), the watch that
learns it for every wait and warns before it passes (``watch``), and what the waited-on rank is doing meanwhile
(``activity``). docs/evidence.md ("The job's own deadline") says where each source comes from."""
