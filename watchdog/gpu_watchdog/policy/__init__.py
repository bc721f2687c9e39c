"""Stage 4, policy (pure): what to do about a finding — the fallback ladder, the restart budget, drain
parameters, hook templates.
"""
