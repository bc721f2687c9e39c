"""Stage 2, evidence: the ranks' stacks (py-spy), what each main thread is doing, which rank the others wait
on, Flight Recorder dumps, and the readable report. Pure analysis plus the py-spy calls that feed it.
"""
