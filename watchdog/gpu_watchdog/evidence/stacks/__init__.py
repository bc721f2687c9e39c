"""The ranks' stacks as an evidence source: py-spy dumps of every thread (``dump``), what each main thread does
(``classify``), a job's dumps and its ranks' workers (``collect``), the diagnosis that names the culprit from
them (``diagnosis``), ranks read from a stack (``spawned_ranks``), and the source lines and system calls that
tell a frame's call (``source_lines``, ``syscalls``)."""
