"""PyTorch's Flight Recorder as an evidence source: the recording settings a job gets and the dumps asked of its
ranks (``dumps``), their analysis across every process group (``analysis``), and what it gives an incident
(``incident``)."""
