"""Trace files: a lossless round trip, and one clear TraceError (exit 65/66 through the CLI) for bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.replay import replay_trace
from gpu_watchdog.errors import EXIT_DATAERR, EXIT_NOINPUT, TraceError
from gpu_watchdog.model import (
    DeviceSample,
    GpuFault,
    GpuProcess,
    JobIdentity,
    NodeSample,
    ProcessSample,
    RankStack,
    SampleError,
    StackEvidence,
)
from gpu_watchdog.sample.record import only_job, record
from gpu_watchdog.sample.trace import FORMAT, SUPPORTED_VERSIONS, VERSION, TraceWriter, read_trace, sample_record
from repo_paths import TESTS

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))
T0 = 1_700_000_000.0


def full_sample(t: float = T0) -> NodeSample:
    job = JobIdentity("job-1", rank=1, local_rank=1, world_size=8)
    return NodeSample(
        t=t, hostname="node-7", backend="nvml",
        devices=(
            DeviceSample(0, "GPU-aaa", "NVIDIA H100 80GB HBM3", util_percent=99.0, mem_util_percent=0.0,
                         mem_used_bytes=40 << 30,
                         mem_total_bytes=80 << 30, power_w=71.5, power_limit_w=700.0, temperature_c=44.0,
                         sm_clock_mhz=1980.0, pcie_tx_bytes_total=10, pcie_rx_bytes_total=20,
                         nvlink_tx_bytes_total=1 << 40, nvlink_rx_bytes_total=(1 << 40) + 1,
                         pcie_link_bytes_per_s=63015384615.38461,
                         sm_clock_max_mhz=1980.0, clock_event_reasons=0x20 | 0x40 | 0x8,
                         pcie_link_gen=4, pcie_link_width=8, pcie_link_gen_max=5, pcie_link_width_max=16,
                         pcie_replay_total=(1 << 40) + 3,
                         processes=(GpuProcess(4242, 40 << 30, 99.0), GpuProcess(4243, None)),
                         unsupported=("process_utilization",)),
            DeviceSample(1, "GPU-bbb", "NVIDIA H100 80GB HBM3", fault=GpuFault("xid", "Xid 79", xid=79)),
            DeviceSample(2, "proc-job-r0", "rank 0 (pid 1)", util_percent=None, virtual=True),
        ),
        processes=(
            ProcessSample(4242, T0 - 100.5, 4000, "sleeping", 12.25, 1 << 33, 3 << 30,
                          ("python", "train.py", "--lr", "3e-4"), job, True, heartbeat_step=812),
            ProcessSample(4243, T0 - 99.0, 4242, "zombie", 0.0, None, 0),
        ),
        errors=(SampleError("AccessDenied", "pid 1"),),
    )


def stack_ev(t: float = T0 + 0.5) -> StackEvidence:
    return StackEvidence("job-1", t, (
        RankStack(0, 4241, "collective", "main;train;all_reduce", False, "all_reduce",
                  "all_reduce (torch/distributed/distributed_c10d.py:2800)"),
        RankStack(1, 4242, "sleep", "main;train;sleep", False),
    ))


# -- round trip ---------------------------------------------------------------------------------------
def test_round_trip_of_every_record_type(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    samples = [full_sample(T0), full_sample(T0 + 1.0)]
    with path.open("w") as f:
        w = TraceWriter(f, "nvml", "node-7", 1.0, T0)
        w.sample(samples[0])
        w.stacks(stack_ev())
        w.event(T0 + 0.75, "hang_onset", rank=1, step=8)
        w.sample(samples[1])
    head, records = read_trace(path)
    assert head == {"type": "header", "format": FORMAT, "version": VERSION, "backend": "nvml",
                    "hostname": "node-7", "interval_s": 1.0, "created": T0}
    got = list(records)
    assert got == [samples[0], stack_ev(), {"t": T0 + 0.75, "name": "hang_onset", "rank": 1, "step": 8},
                   samples[1]]
    assert isinstance(got[0], NodeSample) and isinstance(got[0].devices[0].processes, tuple)


def test_version_2_writes_the_memory_controller_and_the_pcie_link(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    with path.open("w") as f:
        TraceWriter(f, "nvml", "node-7", 1.0, T0).sample(full_sample())
    head, rec = (json.loads(line) for line in path.read_text().splitlines())
    assert VERSION == 2 and head["version"] == 2 and SUPPORTED_VERSIONS == (1, 2)
    dev = rec["devices"][0]
    assert (dev["mem_util_percent"], dev["pcie_link_bytes_per_s"]) == (0.0, 63015384615.38461)
    assert rec["devices"][2]["mem_util_percent"] is None  # proc backend: no memory controller


NEW_DEVICE_FIELDS = ("sm_clock_max_mhz", "clock_event_reasons", "pcie_link_gen", "pcie_link_width",
                     "pcie_link_gen_max", "pcie_link_width_max", "pcie_replay_total")


def test_the_clock_and_link_fields_are_written_and_read_back(tmp_path: Path) -> None:
    """Additive within version 2: the clocks event reasons, the SM clock's maximum, the current and maximum PCIe
    link and the replay counter, as plain JSON numbers, back to the same values (null stays None)."""
    path = tmp_path / "t.trace"
    with path.open("w") as f:
        TraceWriter(f, "nvml", "node-7", 1.0, T0).sample(full_sample())
    head, rec = (json.loads(line) for line in path.read_text().splitlines())
    assert head["version"] == 2
    dev = rec["devices"][0]
    assert [dev[k] for k in NEW_DEVICE_FIELDS] == [1980.0, 0x68, 4, 8, 5, 16, (1 << 40) + 3]
    assert all(rec["devices"][2][k] is None for k in NEW_DEVICE_FIELDS)  # proc backend: unknown
    (sample,) = list(read_trace(path)[1])
    assert sample == full_sample()
    assert isinstance(sample.devices[0].clock_event_reasons, int) and sample.devices[1].pcie_replay_total is None


def test_a_version_2_trace_without_the_clock_and_link_fields_reads_them_as_none(tmp_path: Path) -> None:
    path = tmp_path / "v2.trace"
    head = {"type": "header", "format": FORMAT, "version": 2, "backend": "nvml", "hostname": "vm",
            "interval_s": 1.0, "created": T0}
    device = {**V1_DEVICE, "mem_util_percent": 0.0, "pcie_link_bytes_per_s": 63015384615.38461}
    rec = {"type": "sample", "t": T0, "hostname": "vm", "backend": "nvml", "devices": [device]}
    path.write_text(json.dumps(head) + "\n" + json.dumps(rec) + "\n")
    (sample,) = list(read_trace(path)[1])
    d = sample.devices[0]
    assert d.pcie_link_bytes_per_s == 63015384615.38461 and d.sm_clock_mhz == 1980.0
    assert all(getattr(d, k) is None for k in NEW_DEVICE_FIELDS)


def test_every_stored_trace_still_reads_with_the_clock_and_link_fields_none() -> None:
    traces = sorted((TESTS / "data").rglob("*.trace"))
    assert traces
    for p in traces:
        devices = [d for s in read_trace(p)[1] if isinstance(s, NodeSample) for d in s.devices]
        assert all(getattr(d, k) is None for d in devices for k in NEW_DEVICE_FIELDS), p


# A version-1 sample as version 1 wrote it: every device field of its day, none of version 2's.
V1_DEVICE = {"index": 0, "uuid": "GPU-ea0890a3", "name": "NVIDIA H200", "util_percent": 100.0,
             "mem_used_bytes": 7681343488, "mem_total_bytes": 150754820096, "power_w": 118.352, "power_limit_w": 700.0,
             "temperature_c": 34.0, "sm_clock_mhz": 1980.0, "pcie_tx_bytes_total": 264553584,
             "pcie_rx_bytes_total": 3076899864, "nvlink_tx_bytes_total": None, "nvlink_rx_bytes_total": None,
             "processes": [{"pid": 1180, "used_memory_bytes": 3510632448, "util_percent": 26.0}], "fault": None,
             "unsupported": [], "virtual": False}


def test_a_version_1_trace_still_reads_with_the_new_fields_none(tmp_path: Path) -> None:
    path = tmp_path / "v1.trace"
    head = {"type": "header", "format": FORMAT, "version": 1, "backend": "nvml", "hostname": "vm",
            "interval_s": 1.0, "created": T0}
    rec = {"type": "sample", "t": T0, "hostname": "vm", "backend": "nvml", "devices": [V1_DEVICE]}
    path.write_text(json.dumps(head) + "\n" + json.dumps(rec) + "\n")
    got_head, records = read_trace(path)
    (sample,) = list(records)
    d = sample.devices[0]
    assert got_head["version"] == 1 and d.util_percent == 100.0 and d.power_w == 118.352
    assert d.mem_util_percent is None and d.pcie_link_bytes_per_s is None
    r = subprocess.run([CLI, "replay", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "no findings\n", r.stderr


def test_the_version_1_corpus_still_reads() -> None:
    traces = [p for p in sorted((TESTS / "data").glob("*.trace"))
              if json.loads(p.read_text().split("\n", 1)[0])["version"] == 1]
    assert traces, "no version-1 trace left in tests/data to check"
    for p in traces:
        devices = [d for s in read_trace(p)[1] if isinstance(s, NodeSample) for d in s.devices]
        assert devices and all(d.mem_util_percent is None and d.pcie_link_bytes_per_s is None
                               for d in devices), p


def test_every_line_is_flushed_as_written(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    with path.open("w") as f:
        w = TraceWriter(f, "proc", "h", 1.0, T0)
        w.sample(full_sample())
        assert len(path.read_text().splitlines()) == 2  # a killed recorder leaves a valid prefix
        _head, recs = read_trace(path)
        assert list(recs) == [full_sample()]


class _ListBackend:
    name = "proc"

    def __init__(self, n: int) -> None:
        self.samples = [NodeSample(T0 + i, "h", "proc") for i in range(n)]

    def sample(self) -> NodeSample:
        return self.samples.pop(0)

    def close(self) -> None:
        pass


def test_record_writes_aside_then_renames(tmp_path: Path) -> None:
    clock = iter(float(x) for x in range(100))
    out = tmp_path / "r.trace"
    n = record(_ListBackend(10), out, duration_s=3.0, interval_s=1.0, clock=lambda: next(clock),
               sleep=lambda s: None)
    assert n >= 2 and out.exists() and not (tmp_path / "r.trace.partial").exists()
    head, recs = read_trace(out)
    assert head["backend"] == "proc" and head["interval_s"] == 1.0
    assert [r.t for r in recs] == [T0 + i for i in range(n)]


def _two_jobs(t: float) -> NodeSample:
    """job-1 on GPU-aaa (shared with a process of job-2), job-2 alone on GPU-bbb, and a stray process."""
    a, b = JobIdentity("job-1", rank=0), JobIdentity("job-2", rank=0)
    return NodeSample(
        t=t, hostname="h", backend="nvml",
        devices=(DeviceSample(0, "GPU-aaa", "x", processes=(GpuProcess(11, 1 << 30), GpuProcess(22, 1 << 30))),
                 DeviceSample(1, "GPU-bbb", "x", processes=(GpuProcess(21, 1 << 30),)),
                 DeviceSample(2, "GPU-ccc", "x")),
        processes=(ProcessSample(11, T0, 1, "sleeping", 1.0, 0, 1, job=a, is_rank=True),
                   ProcessSample(21, T0, 1, "sleeping", 1.0, 0, 1, job=b, is_rank=True),
                   ProcessSample(22, T0, 21, "sleeping", 1.0, 0, 1, job=b),
                   ProcessSample(30, T0, 1, "sleeping", 1.0, 0, 1)),
    )


def test_record_one_job_keeps_its_processes_and_devices(tmp_path: Path) -> None:
    class TwoJobs(_ListBackend):
        def __init__(self) -> None:
            self.samples = [_two_jobs(T0 + i) for i in range(5)]

    clock = iter(float(x) for x in range(100))
    out = tmp_path / "j.trace"
    record(TwoJobs(), out, duration_s=2.0, interval_s=1.0, clock=lambda: next(clock), sleep=lambda s: None,
           job_id="job-1")
    recs = list(read_trace(out)[1])
    assert recs and all([p.pid for p in r.processes] == [11] for r in recs)
    assert all([d.uuid for d in r.devices] == ["GPU-aaa"] for r in recs)
    assert recs[0].devices[0].pids == {11, 22}  # a shared GPU stays whole: its counters are the device's
    assert [d.uuid for d in only_job(_two_jobs(T0), "job-2").devices] == ["GPU-aaa", "GPU-bbb"]
    assert only_job(_two_jobs(T0), "nobody").devices == ()


def test_events_and_stacks_do_not_disturb_replay(tmp_path: Path) -> None:
    """The same samples with events and a stack record between them replay to the same findings."""
    plain, mixed = tmp_path / "plain.trace", tmp_path / "mixed.trace"
    with plain.open("w") as fp, mixed.open("w") as fm:
        wp, wm = TraceWriter(fp, "nvml", "node-7", 1.0, T0), TraceWriter(fm, "nvml", "node-7", 1.0, T0)
        for i in range(3):
            wm.event(T0 + i, "note")
            wm.stacks(stack_ev(T0 + i + 0.5))
            for w in (wp, wm):
                w.sample(full_sample(T0 + i))
    found = [f.to_json() for f in replay_trace(plain, DetectConfig())]
    assert [(f["kind"], f["devices"]) for f in found] == [("gpu_fault", ["GPU-bbb"])]
    assert [f.to_json() for f in replay_trace(mixed, DetectConfig())] == found


# -- bad input: one TraceError naming line and field ----------------------------------------------------
def _trace(tmp_path: Path, *lines: str, header: dict | None = None) -> Path:
    head = header if header is not None else {"type": "header", "format": FORMAT, "version": VERSION,
                                              "backend": "proc", "hostname": "h", "interval_s": 1.0,
                                              "created": T0}
    good = json.dumps(sample_record(full_sample()))
    path = tmp_path / "bad.trace"
    path.write_text("\n".join([json.dumps(head), good, *lines]) + "\n")
    return path


def _sample_with(**changes: object) -> str:
    rec = sample_record(full_sample(T0 + 1))
    for dotted, value in changes.items():
        target = rec
        parts = dotted.split("__")
        for p in parts[:-1]:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if value is _DELETE:
            del target[parts[-1]]
        else:
            target[parts[-1]] = value
    return json.dumps(rec)


_DELETE = object()


@pytest.mark.parametrize(("line", "message"), [
    ('{"type": "sample", "t": ', r"bad\.trace:3: malformed JSON"),
    ("[1, 2]", r"bad\.trace:3: a record must be a JSON object"),
    (_sample_with(t=_DELETE), r"bad\.trace:3: t is missing"),
    (_sample_with(hostname=_DELETE), r"bad\.trace:3: hostname is missing"),
    (_sample_with(devices__0__uuid=_DELETE), r"bad\.trace:3: devices\[0\]\.uuid is missing"),
    (_sample_with(t="yesterday"), r"bad\.trace:3: t must be a number"),
    (_sample_with(t=True), r"bad\.trace:3: t must be a number"),
    (_sample_with(t=float("nan")), r"bad\.trace:3: t must be a finite number"),
    (_sample_with(devices__0__util_percent="99"), r"bad\.trace:3: devices\[0\]\.util_percent must be a number"),
    (_sample_with(devices__0__mem_util_percent=True), r"devices\[0\]\.mem_util_percent must be a number"),
    (_sample_with(devices__0__pcie_link_bytes_per_s=float("inf")), r"pcie_link_bytes_per_s must be a finite number"),
    (_sample_with(devices__0__mem_used_bytes=1.5), r"devices\[0\]\.mem_used_bytes must be an integer"),
    (_sample_with(devices__0__clock_event_reasons=32.0), r"devices\[0\]\.clock_event_reasons must be an integer"),
    (_sample_with(devices__0__pcie_link_width="x16"), r"devices\[0\]\.pcie_link_width must be an integer"),
    (_sample_with(devices__0__sm_clock_max_mhz=True), r"devices\[0\]\.sm_clock_max_mhz must be a number"),
    (_sample_with(devices__0__virtual=1), r"devices\[0\]\.virtual must be true or false"),
    (_sample_with(devices__0__processes__1__pid=None), r"devices\[0\]\.processes\[1\]\.pid must be an integer"),
    (_sample_with(processes__0__job__rank="1"), r"processes\[0\]\.job\.rank must be an integer"),
    (_sample_with(processes__0__cmdline="python train.py"), r"processes\[0\]\.cmdline must be a list"),
    (_sample_with(devices={}), r"bad\.trace:3: devices must be a list"),
    (_sample_with(devices__1__fault=[]), r"devices\[1\]\.fault must be an object"),
    (_sample_with(hostname=7), r"hostname must be a string"),
    ('{"type": "telemetry", "t": 1}', r"bad\.trace:3: unknown record type 'telemetry'"),
    ('{"t": 1}', r"bad\.trace:3: unknown record type None"),
    ('{"type": "event", "t": 1}', r"bad\.trace:3: an event needs a numeric t and a string name"),
    ('{"type": "stacks", "job_id": "j", "t": 1, "ranks": [{"rank": 0}]}', r"bad\.trace:3: ranks\[0\]\.pid is missing"),
])
def test_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    path = _trace(tmp_path, line, _sample_with())
    head, records = read_trace(path)
    assert head["version"] == VERSION
    with pytest.raises(TraceError, match=message) as ei:
        list(records)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(("header", "message"), [
    ({"type": "header", "format": FORMAT, "version": 99}, r"bad\.trace:1: unsupported trace version 99"),
    ({"type": "header", "format": FORMAT}, r"unsupported trace version None"),
    ({"type": "header", "format": "other-trace", "version": 1}, "not a gpu-watchdog trace"),
    ({"type": "sample", "t": 1}, "not a gpu-watchdog trace"),
])
def test_bad_headers(tmp_path: Path, header: dict, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(_trace(tmp_path, header=header))


def test_files_that_are_not_traces(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    empty = tmp_path / "empty.trace"
    empty.write_text("")
    gz = tmp_path / "t.trace.gz"
    gz.write_bytes(gzip.compress(b'{"type": "header"}\n' * 50))
    for p in (text, empty, gz):
        with pytest.raises(TraceError, match="not a gpu-watchdog trace"):
            read_trace(p)
    with pytest.raises(TraceError, match="trace not found") as ei:
        read_trace(tmp_path / "missing.trace")
    assert ei.value.exit_code == EXIT_NOINPUT
    with pytest.raises(TraceError, match="no trace in .*: a directory must hold trace.jsonl") as ei:
        read_trace(tmp_path)  # a directory stands for the trace.jsonl an incident directory holds
    assert ei.value.exit_code == EXIT_NOINPUT


def test_invalid_utf8_in_a_later_line(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    with path.open("ab") as f:
        f.write(b'{"type": "event", "t": 1, "name": "\xff\xfe"}\n')
    _head, records = read_trace(path)
    with pytest.raises(TraceError, match=r"bad\.trace:3: not UTF-8"):
        list(records)


def test_replay_rejects_time_going_backwards(tmp_path: Path) -> None:
    path = _trace(tmp_path, json.dumps(sample_record(full_sample(T0 - 5))))
    with pytest.raises(TraceError, match=r"bad\.trace: samples go back in time at t="):
        replay_trace(path, DetectConfig())


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = _trace(tmp_path, "", "   ", _sample_with())
    assert len(list(read_trace(path)[1])) == 2


# -- through the CLI ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "code", "words"), [
    ("malformed", EXIT_DATAERR, "bad.trace:3: malformed JSON"),
    ("field", EXIT_DATAERR, "bad.trace:3: devices[0].uuid is missing"),
    ("version", EXIT_DATAERR, "unsupported trace version 3"),
    ("not-a-trace", EXIT_DATAERR, "not a gpu-watchdog trace"),
    ("missing", EXIT_NOINPUT, "trace not found"),
])
def test_cli_replay_of_a_bad_trace(tmp_path: Path, kind: str, code: int, words: str) -> None:
    if kind == "malformed":
        path = _trace(tmp_path, "{nope")
    elif kind == "field":
        path = _trace(tmp_path, _sample_with(devices__0__uuid=_DELETE))
    elif kind == "version":
        path = _trace(tmp_path, header={"type": "header", "format": FORMAT, "version": 3})
    elif kind == "not-a-trace":
        path = tmp_path / "bad.trace"
        path.write_bytes(b"\x1f\x8b\x08\x00binary")
    else:
        path = tmp_path / "missing.trace"
    for extra in ([], ["--json"]):
        r = subprocess.run([CLI, "replay", str(path), *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == code, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_cli_replay_of_a_good_trace(tmp_path: Path) -> None:
    path = _trace(tmp_path, _sample_with())
    r = subprocess.run([CLI, "replay", str(path), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    findings = json.loads(r.stdout)
    assert [(f["kind"], f["signature"], f["devices"]) for f in findings] == [("gpu_fault", "xid", ["GPU-bbb"])]


def test_cli_record_to_an_unwritable_place_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "no-such-dir" / "t.trace"
    r = subprocess.run([CLI, "record", "--backend", "proc", "--duration", "1", "--output", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64, r.stderr
    assert "--output: cannot write" in r.stderr and "Traceback" not in r.stderr
    assert not out.parent.exists()


def test_a_stacks_record_decodes_back_into_the_same_evidence() -> None:
    """What the agents publish to a shared directory (store.job_runs) is a trace's stacks record, read back whole;
    anything else is None, never an exception."""
    from gpu_watchdog.model import RankStack, StackEvidence
    from gpu_watchdog.sample.trace import stacks_from_record, stacks_record

    ev = StackEvidence("job-7", 12.5, (RankStack(2, 4242, "collective", "sig", False, "ddp_all_reduce", "w", 3, 4,
                                                 timed=False, io_before=10, io_after=12),))
    assert stacks_from_record(json.loads(json.dumps(stacks_record(ev)))) == ev
    assert stacks_from_record({"type": "stacks", "job_id": "j"}) is None  # t missing
    assert stacks_from_record([1, 2]) is None
