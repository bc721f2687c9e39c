"""NCCL RAS at an incident (an ``evidence.source``): two polls compared (``evidence.nccl_ras.poll``), kept as
``ras.json`` in the incident, ``ras_culprit_ranks`` and ``ras_hung_communicators`` in its summary. Nothing at all
for a job RAS is not asked about (a gloo job, ``ras.enabled = off``)."""

from __future__ import annotations

from gpu_watchdog.evidence.culprit import NCCL_RAS, SourceVerdict
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller, write_ras_evidence
from gpu_watchdog.evidence.source import Begin, Found, IncidentJob


class NcclRasAtIncident:
    action = "nccl_ras"

    def __init__(self, poller: RasPoller) -> None:
        self.poller = poller

    def gather(self, job: IncidentJob, begin: Begin) -> Found | None:
        addr = self.poller.address(job.job_id, job.rank_pids)
        if addr is None:
            return None
        begin(addr)
        try:
            evidence = self.poller.incident_evidence(job.job_id, job.rank_pids, job.world_size)
            write_ras_evidence(job.incident_dir, evidence)
        except Exception as e:  # diagnostics must never block recovery
            return Found(False, f"nccl ras: {e}")
        hung = bool(evidence.hung)
        verdict = SourceVerdict(NCCL_RAS, tuple(evidence.culprit_ranks) if hung else (), evidence.summary,
                                desync=evidence.desync, inside_collective=evidence.frozen_equal)
        # A frozen count with every rank inside the same collective says "communication" only beside the GPUs'
        # NCCL spin; ranks behind always do.
        comm = verdict.culprit_ranks or (verdict.inside_collective and job.spin)
        return Found(hung, evidence.summary, verdict=verdict, communication=f"NCCL RAS: {evidence.summary}" if comm
                     else "", section={"ras_culprit_ranks": evidence.culprit_ranks,
                                       "ras_hung_communicators": len(evidence.hung)},
                     said=(evidence.summary,) if hung else ())
