"""Stage 3, detect (pure): samples + stack evidence → job states and findings; replay of a trace; the
ranks' launch-settings check.
"""
